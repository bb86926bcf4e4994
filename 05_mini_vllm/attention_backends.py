"""Attention backends: write this step's K/V into the paged cache, then attend.

vLLM counterparts: `vllm/v1/attention/backends/` (`flash_attn.py`,
`triton_attn.py`; `FlashAttentionImpl.forward`) and the backend selector
`vllm/attention/selector.py` (`get_attn_backend`).

Every backend has one entry point, `forward(query, key, value, key_cache,
value_cache, md, scale)`, for a whole mixed batch (prefill chunks and decodes
together, laid out by the `AttentionMetadata` md):

1. it FIRST scatters the batch's new keys/values into the cache at
   `md.slot_mapping` (every token of every sequence), and
2. THEN runs ONE varlen paged-attention call over the batch.

The order is an invariant, not a detail: a sequence may read blocks that
another sequence of the same step writes (a prefix-cache hit on blocks being
filled in this very step), and a prefill chunk reads its own fresh keys from
the cache. Both work only if the whole batch is written before anything reads.

Backends:
* "triton": the Triton kernels of `mini_vllm.kernels`;
* "torch": vectorised PyTorch (one gather through the block tables, one
  masked `scaled_dot_product_attention`), checked against Chapter 1's
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

    Layout: sequences become rows of a padded [num_seqs, max_query_len] query
    tensor and a padded [num_seqs, max_seq_len] key/value tensor. Padding and
    positions past seq_len are masked out; their K/V are gathered from the
    sequence's position 0 (always valid), so NaN or stale data in unused cache
    slots never enters the product (0 * NaN would be NaN even under a mask).
    GQA: the query heads of one KV head are folded into the query-length axis,
    so K/V are never repeated.
    """

    name = "torch"

    def forward(self, query, key, value, key_cache, value_cache, md: AttentionMetadata, scale: float):
        torch_reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping)
        return self.attend(query, key_cache, value_cache, md, scale)

    @staticmethod
    def attend(query, key_cache, value_cache, md: AttentionMetadata, scale: float):
        num_tokens, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        group = num_heads // num_kv_heads
        num_seqs, max_q, max_s = md.num_seqs, md.max_query_len, md.max_seq_len
        dev = query.device
        if num_tokens == 0:
            return torch.empty_like(query)

        # Host-side index math from the *_cpu lists: no device read-back.
        q_lens = torch.tensor(md.query_lens_cpu, dtype=torch.int64)
        s_lens = torch.tensor(md.seq_lens_cpu, dtype=torch.int64)
        seq_of_tok = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
        starts = torch.cumsum(q_lens, 0) - q_lens
        off_of_tok = torch.arange(num_tokens) - starts[seq_of_tok]
        # Absolute position of each padded query row; rows past q_len are
        # padding (their output is dropped) but still see key 0, so no row is
        # fully masked.
        q_pos = (s_lens - q_lens)[:, None] + torch.arange(max_q)[None, :]          # [S, Qm]
        k_pos = torch.arange(max_s)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]                            # [S, Qm, L]
        valid = k_pos[None, :] < s_lens[:, None]                                    # [S, L]
        seq_of_tok, off_of_tok, mask, valid, k_pos_dev = (
            t.to(dev, non_blocking=True) for t in (seq_of_tok, off_of_tok, mask, valid, k_pos))

        # Slot of every (sequence, key position); invalid positions -> slot of position 0.
        num_cols = -(-max_s // block_size)
        table = md.block_tables[:, :num_cols].long()
        blocks = table[:, k_pos_dev // block_size]                                  # [S, L]
        slots = blocks * block_size + k_pos_dev % block_size
        slots = torch.where(valid, slots, slots[:, :1])
        k = key_cache.view(-1, num_kv_heads, head_dim)[slots]                      # [S, L, KVH, D]
        v = value_cache.view(-1, num_kv_heads, head_dim)[slots]
        k, v = k.transpose(1, 2), v.transpose(1, 2)                                 # [S, KVH, L, D]

        q = query.new_zeros(num_seqs, max_q, num_heads, head_dim)
        q[seq_of_tok, off_of_tok] = query
        # Head h reads KV head h // group: fold the group into the query axis.
        q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
        m = mask[:, None, None].expand(num_seqs, 1, group, max_q, max_s).reshape(num_seqs, 1, group * max_q, max_s)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)     # [S, KVH, G*Qm, D]
        o = o.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(num_seqs, max_q, num_heads, head_dim)
        return o[seq_of_tok, off_of_tok]


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
