"""Attention backends: write this step's K/V into the paged cache, then attend.

vLLM counterparts: `vllm/v1/attention/backends/` (`flash_attn.py`,
`triton_attn.py`; `FlashAttentionImpl.forward`) and the backend selector
`vllm/attention/selector.py` (`get_attn_backend`).

Every backend has one entry point, `forward(query, key, value, key_cache,
value_cache, md, scale)`, for a whole mixed batch (prefill chunks and decodes
together, laid out by the `AttentionMetadata` md):

1. it FIRST scatters the batch's new keys/values into the cache at
   `md.slot_mapping` (every token of every sequence), and
2. THEN attends over the whole batch at once (no per-sequence loop): one
   varlen kernel launch for "triton"; two padded SDPA calls for "torch", one
   for the decodes and one for the prefill chunks.

The order is an invariant, not a detail: a sequence may read blocks that
another sequence of the same step writes (a prefix-cache hit on blocks being
filled in this very step), and a prefill chunk reads its own fresh keys from
the cache. Both work only if the whole batch is written before anything reads.

Backends:
* "triton": the Triton kernels of `mini_vllm.kernels`;
* "torch": vectorised PyTorch (one gather through the block tables and one
  masked `scaled_dot_product_attention` per group), checked against Chapter 1's
  per-sequence reference `mini_vllm.paged_attention.paged_attention_varlen`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mini_vllm.forward_context import AttentionMetadata
from mini_vllm.paged_attention import reshape_and_cache as torch_reshape_and_cache

BACKEND_NAMES = ("torch", "triton")


class TorchAttentionBackend:
    """Padded-batch attention in plain PyTorch.

    Layout: the sequences of a group become rows of a padded
    [num_seqs, max_query_len] query tensor and a padded [num_seqs, max_seq_len]
    key/value tensor, gathered slot by slot through the block tables in one
    `index_select`. Padding and positions past seq_len are masked out; their
    K/V are gathered from the sequence's position 0 (always valid), so NaN or
    stale data in unused cache slots never enters the product (0 * NaN would
    be NaN even under a mask). GQA: the query heads of one KV head are folded
    into the query-length axis, so K/V are never repeated.

    Groups: decodes (q_len 1) and the rest (prefills, chunks) are padded
    separately, as vLLM's FlashInfer backend splits its batch, so one long
    prefill chunk does not pad every decode to its length.
    """

    name = "torch"

    def forward(self, query, key, value, key_cache, value_cache, md: AttentionMetadata, scale: float):
        torch_reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping)
        return self.attend(query, key_cache, value_cache, md, scale)

    @classmethod
    def attend(cls, query, key_cache, value_cache, md: AttentionMetadata, scale: float):
        q_lens, s_lens = md.query_lens_cpu, md.seq_lens_cpu
        if not q_lens:
            return torch.empty_like(query)
        decodes = [i for i, q in enumerate(q_lens) if q == 1]
        if len(decodes) in (0, len(q_lens)):  # one group: no split, no copy back
            return cls._attend_group(query, key_cache, value_cache, md.block_tables, q_lens, s_lens, scale)
        rest = [i for i, q in enumerate(q_lens) if q != 1]
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        out = torch.empty_like(query)
        for seqs in (decodes, rest):
            rows = torch.tensor([r for i in seqs for r in range(starts[i], starts[i + 1])]).to(query.device)
            seq_idx = torch.tensor(seqs).to(query.device)
            out[rows] = cls._attend_group(query[rows], key_cache, value_cache, md.block_tables[seq_idx],
                                          [q_lens[i] for i in seqs], [s_lens[i] for i in seqs], scale)
        return out

    @staticmethod
    def _attend_group(query, key_cache, value_cache, block_tables, q_lens: list[int], s_lens: list[int], scale):
        num_tokens, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        group = num_heads // num_kv_heads
        num_seqs, max_q, max_s = len(q_lens), max(q_lens), max(s_lens)
        dev = query.device

        # Host-side index math from the host lists: no device read-back.
        q_len_t = torch.tensor(q_lens, dtype=torch.int64)
        s_len_t = torch.tensor(s_lens, dtype=torch.int64)
        seq_of_tok = torch.repeat_interleave(torch.arange(num_seqs), q_len_t)
        off_of_tok = torch.arange(num_tokens) - (torch.cumsum(q_len_t, 0) - q_len_t)[seq_of_tok]
        # Absolute position of each padded query row; rows past q_len are
        # padding (their output is dropped) but still see key 0, so no row is
        # fully masked.
        q_pos = (s_len_t - q_len_t)[:, None] + torch.arange(max_q)[None, :]        # [S, Qm]
        k_pos = torch.arange(max_s)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]                            # [S, Qm, L]
        valid = k_pos[None, :] < s_len_t[:, None]                                   # [S, L]
        seq_of_tok, off_of_tok, mask, valid, k_pos = (
            t.to(dev, non_blocking=True) for t in (seq_of_tok, off_of_tok, mask, valid, k_pos))

        # Slot of every (sequence, key position); invalid positions -> slot of position 0.
        table = block_tables[:, :-(-max_s // block_size)].long()
        slots = table[:, k_pos // block_size] * block_size + k_pos % block_size    # [S, L]
        slots = torch.where(valid, slots, slots[:, :1]).flatten()
        k = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        v = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        k = k.view(num_seqs, max_s, num_kv_heads, head_dim).transpose(1, 2)        # [S, KVH, L, D]
        v = v.view(num_seqs, max_s, num_kv_heads, head_dim).transpose(1, 2)

        if max_q == 1:  # decode group: rows are already one per sequence
            q = query
        else:
            q = query.new_zeros(num_seqs, max_q, num_heads, head_dim)
            q[seq_of_tok, off_of_tok] = query
        # Head h reads KV head h // group: fold the group into the query axis.
        q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
        m = mask[:, None, None].expand(num_seqs, 1, group, max_q, max_s).reshape(num_seqs, 1, group * max_q, max_s)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)     # [S, KVH, G*Qm, D]
        o = o.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(num_seqs, max_q, num_heads, head_dim)
        return o.reshape(num_tokens, num_heads, head_dim) if max_q == 1 else o[seq_of_tok, off_of_tok]


class TritonAttentionBackend:
    """Chapter 1's Triton kernels (`mini_vllm.kernels`): the GPU path."""

    name = "triton"

    def forward(self, query, key, value, key_cache, value_cache, md: AttentionMetadata, scale: float):
        # Imported lazily: importing triton is slow and the torch backend never needs it.
        from mini_vllm.kernels.paged_attention import paged_attention_varlen
        from mini_vllm.kernels.reshape_and_cache import reshape_and_cache

        reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping)
        return paged_attention_varlen(query, key_cache, value_cache, md.block_tables,
                                      md.cu_seqlens_q, md.seq_lens, scale)


_BACKENDS = {"torch": TorchAttentionBackend, "triton": TritonAttentionBackend}


def get_attn_backend(name: str):
    """The backend called `name` ("torch" or "triton")."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    return _BACKENDS[name]()


def default_backend(device) -> str:
    """"triton" on CUDA (compiled kernels), "torch" elsewhere (the Triton
    interpreter is far too slow to serve a model on a CPU)."""
    return "triton" if torch.device(device).type == "cuda" else "torch"
