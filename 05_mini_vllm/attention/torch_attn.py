"""Paged attention for a whole mixed batch in plain PyTorch (the CPU backend).

vLLM has no CPU counterpart of this exact code; its shape follows the
FlashInfer backend (`vllm/v1/attention/backends/flashinfer.py`), which plans a
batch once per step and splits decodes from prefills.

Per step, `plan()` (stored as the step's `TorchAttentionMetadata` in
`AttentionMetadata.backend_metadata` by the first layer, reused by the others):
* splits the sequences into groups: prefill chunks bucketed by query x key
  size, decodes by key length (sorted, a new bucket when the size falls below
  2/3 of the bucket's first), so a few long sequences do not pad every short
  one to their length;
* builds, per group, the list of cache *blocks* to gather (whole blocks are
  contiguous in the cache, so one `index_select` copies block_size rows at a
  time), the causal/length mask, and where each query row goes.
Per layer, `attend()` gathers K/V block by block, zeroes (by index) every
position past a sequence's length (stale or NaN data in a partly filled block or behind a
-1 table entry never reaches the product: 0 * NaN would be NaN even under a
mask), and runs one `scaled_dot_product_attention` per group. An fp8 cache's
gathered blocks are dequantised (stored * scale) to the query's dtype first. GQA: the query
heads of a KV head are folded into the query axis, so K/V are never repeated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mini_vllm.kernels.kv_cache_dtype import dequantize, is_fp8

_MIN_BUCKET = 4  # fewer sequences than this do not get a bucket of their own


@dataclass
class GroupPlan:
    rows: torch.Tensor | None      # query rows of the group (None: every row, in order)
    num_seqs: int
    max_q: int
    max_s: int
    block_ids: torch.Tensor        # [S * num_blocks] cache blocks to gather
    num_blocks: int
    invalid: torch.Tensor          # flat (sequence, slot) rows past seq_len in the gathered blocks
    mask: torch.Tensor             # [S, max_q, max_s] True where query may see key
    seq_of_tok: torch.Tensor | None  # prefill: padded (sequence, offset) of each query row
    off_of_tok: torch.Tensor | None


@dataclass
class TorchAttentionMetadata:
    """The torch backend's own metadata of one step: its groups, in order."""

    groups: list[GroupPlan]


def _buckets(seqs: list[int], size, min_bucket: int = _MIN_BUCKET) -> list[list[int]]:
    """Sequences sorted by `size(i)` (longest first), cut into buckets whose
    sizes stay within 1.5x of the bucket's first, so padding wastes at most a
    third of a bucket's work."""
    order = sorted(seqs, key=lambda i: -size(i))
    out: list[list[int]] = []
    for i in order:
        if out and (size(i) * 3 > size(out[-1][0]) * 2 or len(out[-1]) < min_bucket):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _group_plan(seqs, starts, q_lens, s_lens, block_tables, block_size, dev, everything) -> GroupPlan:
    ql = torch.tensor([q_lens[i] for i in seqs])
    sl = torch.tensor([s_lens[i] for i in seqs])
    n, max_q, max_s = len(seqs), int(ql.max()), int(sl.max())
    nblk = -(-max_s // block_size)
    idx = torch.tensor(seqs, device=block_tables.device)
    table = block_tables.index_select(0, idx)[:, :nblk].long().clamp(min=0)  # -1 -> 0, masked below
    k_pos = torch.arange(max_s)
    q_pos = (sl - ql)[:, None] + torch.arange(max_q)[None, :]
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    rows = seq_of_tok = off_of_tok = None
    if not everything:
        rows = torch.tensor([r for i in seqs for r in range(starts[i], starts[i + 1])], device=dev)
    if max_q > 1:
        seq_of_tok = torch.repeat_interleave(torch.arange(n), ql).to(dev)
        off_of_tok = (torch.arange(int(ql.sum())) - torch.repeat_interleave(torch.cumsum(ql, 0) - ql, ql)).to(dev)
    # Rows of the gathered [S * nblk * block_size] K/V that lie past seq_len: zeroed by
    # index, which touches only those rows (a masked_fill would rewrite every row).
    width = nblk * block_size
    past = torch.arange(width)[None, :] >= sl[:, None]
    invalid = torch.arange(n * width).view(n, width)[past].to(dev)
    return GroupPlan(rows, n, max_q, max_s, table.flatten().to(dev), nblk, invalid, mask.to(dev),
                     seq_of_tok, off_of_tok)


def plan(md, block_size: int, device) -> list[GroupPlan]:
    """The step's groups; computed by the first layer, reused by the others."""
    if isinstance(md.backend_metadata, TorchAttentionMetadata):
        return md.backend_metadata.groups
    q_lens, s_lens = md.query_lens_cpu, md.seq_lens_cpu
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    decodes = [i for i, q in enumerate(q_lens) if q == 1]
    rest = [i for i, q in enumerate(q_lens) if q != 1]
    # Prefill chunks pad to the longest query and key length of their group, so
    # they are bucketed by query x key size; decodes by key length.
    groups = (_buckets(rest, lambda i: q_lens[i] * s_lens[i], 1) if rest else []) + \
        (_buckets(decodes, lambda i: s_lens[i]) if decodes else [])
    everything = len(groups) == 1 and groups[0] == list(range(len(q_lens)))
    out = [_group_plan(g, starts, q_lens, s_lens, md.block_tables, block_size, device, everything)
           for g in groups]
    md.backend_metadata = TorchAttentionMetadata(out)
    return out


def attend(query, key_cache, value_cache, md, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    g = num_heads // num_kv_heads
    plans = plan(md, block_size, query.device)
    out = query if len(plans) == 1 and plans[0].rows is None else torch.empty_like(query)
    for p in plans:
        S, Qm, L = p.num_seqs, p.max_q, p.max_s
        width = p.num_blocks * block_size
        k = key_cache.index_select(0, p.block_ids).view(S * width, num_kv_heads, head_dim)
        v = value_cache.index_select(0, p.block_ids).view(S * width, num_kv_heads, head_dim)
        if is_fp8(key_cache.dtype):  # dequantised in the query's dtype, what SDPA takes
            k = (dequantize(k, k_scale)).to(query.dtype)
            v = (dequantize(v, v_scale)).to(query.dtype)
        if p.invalid.numel():
            k.index_fill_(0, p.invalid, 0)
            v.index_fill_(0, p.invalid, 0)
        k = k.view(S, width, num_kv_heads, head_dim)[:, :L].transpose(1, 2)  # [S, KVH, L, D]
        v = v.view(S, width, num_kv_heads, head_dim)[:, :L].transpose(1, 2)
        q_rows = query if p.rows is None else query.index_select(0, p.rows)
        if Qm == 1:
            q = q_rows
        else:
            q = q_rows.new_zeros(S, Qm, num_heads, head_dim)
            q[p.seq_of_tok, p.off_of_tok] = q_rows
        # Head h reads KV head h // g: fold the g query heads of a KV head into the query axis.
        q = q.view(S, Qm, num_kv_heads, g, head_dim).permute(0, 2, 3, 1, 4).reshape(S, num_kv_heads, g * Qm, head_dim)
        m = p.mask[:, None, None].expand(S, 1, g, Qm, L).reshape(S, 1, g * Qm, L)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)  # [S, KVH, g*Qm, D]
        o = o.view(S, num_kv_heads, g, Qm, head_dim).permute(0, 3, 1, 2, 4).reshape(S, Qm, num_heads, head_dim)
        o = o.reshape(S, num_heads, head_dim) if Qm == 1 else o[p.seq_of_tok, p.off_of_tok]
        if p.rows is None:
            return o.to(query.dtype)
        out[p.rows] = o.to(query.dtype)
    return out
