"""Per-step attention metadata: how one varlen batch lies in the paged KV cache.

vLLM counterpart: `CommonAttentionMetadata` in `vllm/v1/attention/backends/utils.py`,
from which each backend's metadata builder builds its own metadata once per
step (`FlashAttentionMetadataBuilder.build` -> `FlashAttentionMetadata`). The
runner builds one per step and validates it once; every attention layer of
that forward pass reads it through `mini_vllm.forward_context`. A backend's
own metadata (`backend_metadata`) is built by the step's first layer and
reused by the others, so per-step work is never repeated per layer.

Invariants (checked once per step by `AttentionMetadata.validate`):
* `slot_mapping[t]` is the cache slot of the t-th scheduled token (-1: write nothing);
* sequence i owns query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, which are
  its last `q_len` positions out of `seq_lens[i]`;
* `block_tables` is int32, one row per sequence, padded with -1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    # Per-step state, not inputs (init=False: the constructor never takes them).
    # The backend's own metadata of this step, made by its builder on the first
    # layer: `backends.CPUAttentionMetadata` ("cpu"), `torch_attn.TorchAttentionMetadata`
    # ("torch"); None until then. Each backend checks the type it builds.
    backend_metadata: Any = field(default=None, init=False, repr=False, compare=False)
    # The cache shape (num_blocks, block_size) that `validate` last passed.
    _validated_for: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self, num_blocks: int, block_size: int) -> None:
        """Chapter 1's argument checks, once per step (not once per layer). A
        second call for the same cache shape (the runner checks, then the cpu
        backend, which may also be called without a runner) returns at once."""
        if self._validated_for == (num_blocks, block_size):
            return
        from mini_vllm.kernels.paged_checks import check_cu_seqlens_q, check_slot_range, check_table_entries

        check_cu_seqlens_q(self.cu_seqlens_q, self.seq_lens, self.num_tokens, self.seq_lens.device)
        check_table_entries(self.block_tables, self.seq_lens, block_size, num_blocks)
        check_slot_range(self.slot_mapping, num_blocks * block_size)
        self._validated_for = (num_blocks, block_size)

    def with_tensors(self, slot_mapping, block_tables, cu_seqlens_q, seq_lens) -> "AttentionMetadata":
        """The same step with these tensors (the host ones uploaded, say), still
        marked as validated: the caller passes copies of the checked tensors."""
        out = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
                                seq_lens=seq_lens, max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
                                query_lens_cpu=self.query_lens_cpu, seq_lens_cpu=self.seq_lens_cpu)
        out._validated_for = self._validated_for
        return out

    def to(self, device) -> "AttentionMetadata":
        """The same metadata with its tensors on `device`, still marked as validated:
        the runner checks the host copies (no GPU-to-host reads) and uploads once."""
        if self.slot_mapping.device == torch.device(device):
            return self
        return self.with_tensors(*(t.to(device, non_blocking=True) for t in
                                   (self.slot_mapping, self.block_tables, self.cu_seqlens_q, self.seq_lens)))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
