"""Per-step attention metadata, visible to every attention layer of one forward pass.

vLLM counterparts: `vllm/forward_context.py` (`set_forward_context`,
`get_forward_context`) and the metadata builders in
`vllm/v1/attention/backends/` (`FlashAttentionMetadata`).

The runner builds one `AttentionMetadata` per step and validates it once; the
model's attention layers read it from the forward context instead of passing
it down through every module's `forward`, so model code stays shaped like the
Hugging Face code it mirrors.

Invariants (checked once per step by `AttentionMetadata.validate`):
* `slot_mapping[t]` is the cache slot of the t-th scheduled token (-1: write nothing);
* sequence i owns query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, which are
  its last `q_len` positions out of `seq_lens[i]`;
* `block_tables` is int32, one row per sequence, padded with -1.
"""
from __future__ import annotations

from contextlib import contextmanager
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
        """Chapter 1's argument checks, once per step (not once per layer)."""
        from mini_vllm.kernels.paged_checks import check_cu_seqlens_q, check_table_entries

        check_cu_seqlens_q(self.cu_seqlens_q, self.seq_lens, self.num_tokens, self.seq_lens.device)
        check_table_entries(self.block_tables, self.seq_lens, block_size, num_blocks)
        sm = self.slot_mapping
        if sm.numel() and (int(sm.min()) < -1 or int(sm.max()) >= num_blocks * block_size):
            raise ValueError(f"slot_mapping entries must be -1 or in [0, {num_blocks * block_size})")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


_CURRENT: AttentionMetadata | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None):
    """Make `attn_metadata` the metadata of the forward pass run inside the block."""
    global _CURRENT
    prev, _CURRENT = _CURRENT, attn_metadata
    try:
        yield
    finally:
        _CURRENT = prev


def get_forward_context() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("attention ran outside set_forward_context(...): the runner must "
                           "wrap every forward pass so attention knows the batch layout")
    return _CURRENT
