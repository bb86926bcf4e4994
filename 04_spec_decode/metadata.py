"""Bookkeeping of a verify step: where drafts sit in the batch, and what
verification does to a request's progress counters.

vLLM counterparts: `vllm/v1/spec_decode/metadata.py` (`SpecDecodeMetadata`)
and the spec-decode branch of `Scheduler.update_from_output` in
`vllm/v1/core/sched/scheduler.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SpecDecodeMetadata:
    """Layout of a verify batch. Request b owns k_b draft tokens.

    The target forward pass of request b runs on [last token, d_1, ..., d_k]
    and returns k_b + 1 logits rows: rows for the k_b draft positions, then one
    bonus row. Over the batch, logits have sum(k_b + 1) rows, request-major.
    """

    draft_token_ids: torch.Tensor  # [T] int64, T = sum(k_b)
    num_draft_tokens: torch.Tensor  # [B] int64
    cu_num_draft_tokens: torch.Tensor  # [B] int64, inclusive prefix sum
    target_logits_indices: torch.Tensor  # [T] rows of the logits that verify drafts
    bonus_logits_indices: torch.Tensor  # [B] rows that give the bonus token

    @property
    def max_spec_len(self) -> int:
        return int(self.num_draft_tokens.max()) if self.num_draft_tokens.numel() else 0

    @classmethod
    def make(cls, draft_token_ids: list[list[int]], device="cpu") -> "SpecDecodeMetadata":
        num = torch.tensor([len(d) for d in draft_token_ids], dtype=torch.int64)
        flat = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.int64)
        cu = torch.cumsum(num, 0)
        # Request b's logits start at row cu[b-1] + b (each earlier request has k + 1 rows).
        row_start = cu - num + torch.arange(num.shape[0])
        target = torch.cat([torch.arange(s, s + n) for s, n in zip(row_start.tolist(), num.tolist())]) if num.numel() else num
        bonus = row_start + num
        return cls(flat.to(device), num.to(device), cu.to(device), target.to(torch.int64).to(device), bonus.to(device))


def apply_verify_step(num_computed_tokens: int, num_tokens: int, num_draft_tokens: int, num_accepted: int) -> tuple[int, int]:
    """Progress counters after one verify step, as seed 001 Table 4.1 states them.

    Before the step the request has `num_computed_tokens` tokens in its KV cache
    and `num_tokens` tokens in total (computed + the one sampled last step).
    The scheduler schedules Delta = 1 + L_draft tokens (the pending token plus
    the drafts). Verification accepts `num_accepted` drafts, so
    L_rejected = L_draft - num_accepted, and (seed 001 §4.4, Table 4.1):

        num_computed_tokens += Delta - L_rejected
        num_tokens          += L_draft - L_rejected + 1   (accepted + 1 new token)

    vLLM splits the first update in two: `schedule()` adds Delta, then
    `update_from_output` subtracts the rejected count. The KV entries of
    rejected drafts are simply overwritten later.
    Invariant kept: num_tokens == num_computed_tokens + 1 after every step.
    """
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    if not 0 <= num_accepted <= num_draft_tokens:
        raise ValueError(f"num_accepted must lie in [0, num_draft_tokens={num_draft_tokens}], got {num_accepted}")
    if num_tokens != num_computed_tokens + 1:
        raise ValueError(
            f"a verify step needs exactly one pending token: num_tokens ({num_tokens}) must equal "
            f"num_computed_tokens ({num_computed_tokens}) + 1"
        )
    delta = 1 + num_draft_tokens
    rejected = num_draft_tokens - num_accepted
    return num_computed_tokens + delta - rejected, num_tokens + num_draft_tokens - rejected + 1


def num_accepted_from_output(output_row: torch.Tensor, num_draft_tokens: int) -> int:
    """Accepted drafts of one request from its sampler output row (emitted tokens minus one)."""
    emitted = int((output_row != -1).sum())
    if not 1 <= emitted <= num_draft_tokens + 1:
        raise ValueError(f"an output row must emit 1..{num_draft_tokens + 1} tokens, got {emitted}")
    return emitted - 1
