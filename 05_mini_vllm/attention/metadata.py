"""Per-step attention metadata: how one varlen batch lies in the paged KV cache.

vLLM counterpart: the metadata of the attention backends in
`vllm/v1/attention/backends/` (`FlashAttentionMetadata`, built once per step by
its metadata builder). The runner builds one per step and validates it once;
every attention layer of that forward pass reads it through
`mini_vllm.forward_context`.

Invariants (checked once per step by `AttentionMetadata.validate`):
* `slot_mapping[t]` is the cache slot of the t-th scheduled token (-1: write nothing);
* sequence i owns query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, which are
  its last `q_len` positions out of `seq_lens[i]`;
* `block_tables` is int32, one row per sequence, padded with -1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [num_tokens] int64
    block_tables: torch.Tensor   # [num_seqs, max_blocks] int32, -1 padded
    cu_seqlens_q: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor       # [num_seqs] int32
    max_query_len: int
    max_seq_len: int
    # Host copies (lists), so a backend never syncs to read lengths back.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    def validate(self, num_blocks: int, block_size: int) -> None:
        """Chapter 1's argument checks, once per step (not once per layer). A
        second call for the same cache shape (the runner checks, then the cpu
        backend, which may also be called without a runner) returns at once."""
        if getattr(self, "_validated_for", None) == (num_blocks, block_size):
            return
        from mini_vllm.kernels.paged_checks import check_cu_seqlens_q, check_table_entries

        check_cu_seqlens_q(self.cu_seqlens_q, self.seq_lens, self.num_tokens, self.seq_lens.device)
        check_table_entries(self.block_tables, self.seq_lens, block_size, num_blocks)
        sm = self.slot_mapping
        if sm.numel() and (int(sm.min()) < -1 or int(sm.max()) >= num_blocks * block_size):
            raise ValueError(f"slot_mapping entries must be -1 or in [0, {num_blocks * block_size})")
        self._validated_for = (num_blocks, block_size)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
