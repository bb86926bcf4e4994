"""Deliberately *wrong* rejection samplers, kept as controls.

A statistical test that passes every sampler proves nothing. These variants
have `rejection_sample`'s signature and are each lossy in a classic way; the
chapter's tests assert that the lossless test (stats.py) rejects them.
No vLLM counterpart.
"""
from __future__ import annotations

import torch

from .rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample


def accept_always(draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_noise):
    """Bug: trust the draft blindly. Emits every draft plus the bonus, so position i follows q_i."""
    num = num_draft_tokens.to(torch.int64)
    batch = num.shape[0]
    max_k = int(num.max()) if batch else 0
    out = torch.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(batch), num)
    pos = torch.arange(num.sum()) - (torch.cumsum(num, 0) - num)[req]
    out[req, pos] = draft_token_ids.to(torch.int64)
    out[torch.arange(batch), num] = bonus_token_ids.to(torch.int64)
    return out


def recover_from_target(draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_noise):
    """Bug: on rejection, resample from p instead of the residual max(0, p - q).

    Tokens the draft over-proposes then come out too often: the accepted mass
    min(p, q) is counted twice.
    """
    out = rejection_sample(draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_noise)
    num = num_draft_tokens.to(torch.int64)
    last = (out != PLACEHOLDER_TOKEN_ID).sum(dim=1) - 1
    rejected = torch.nonzero(last < num).squeeze(1)  # requests whose last token was recovered
    starts = torch.cumsum(num, 0) - num
    rows = starts[rejected] + last[rejected]
    out[rejected, last[rejected]] = (target_probs[rows] / recovery_noise[rejected]).argmax(dim=-1)
    return out
