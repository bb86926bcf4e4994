"""Input checks shared by every rejection-sampler implementation (reference,
batched PyTorch, Triton kernel), so all of them fail the same clear way.

vLLM counterpart: the asserts at the top of `rejection_sample` in
`vllm/v1/sample/rejection_sampler.py`.
"""
from __future__ import annotations

import torch

# A row of probabilities must sum to 1 within this tolerance (fp32 softmax over
# 32k entries is accurate to ~1e-6; 1e-3 still rejects unnormalised scores).
PROB_SUM_TOL = 1e-3


def _check_tensor(name, t, ndim, dtypes):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def check_distribution(name: str, probs: torch.Tensor) -> None:
    """Every row of probs is finite, non-negative and sums to 1.

    Two passes over the data (min and row sums; a NaN or inf anywhere makes its
    row sum non-finite), which matters at 32k-entry rows.
    """
    if not probs.numel():
        return
    sums = probs.sum(dim=-1)
    if not torch.isfinite(sums).all():
        raise ValueError(f"{name} must be finite (no NaN/inf)")
    low = float(probs.min())
    if low < 0:
        raise ValueError(f"{name} must be non-negative, got min {low}")
    err = float((sums - 1).abs().max())
    if err > PROB_SUM_TOL:
        raise ValueError(f"each row of {name} must sum to 1 (within {PROB_SUM_TOL}), worst row is off by {err:.3g}")


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{name} must lie in [0, {vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]")


def validate_rejection_inputs(
    draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_noise
) -> tuple[int, int, int]:
    """Check the shared contract; return (batch_size, vocab_size, max_num_draft_tokens)."""
    ints = (torch.int32, torch.int64)
    floats = (torch.float32,)
    _check_tensor("draft_token_ids", draft_token_ids, 1, ints)
    _check_tensor("num_draft_tokens", num_draft_tokens, 1, ints)
    _check_tensor("target_probs", target_probs, 2, floats)
    _check_tensor("bonus_token_ids", bonus_token_ids, 1, ints)
    _check_tensor("is_greedy", is_greedy, 1, (torch.bool,))
    _check_tensor("uniform_probs", uniform_probs, 1, floats)
    _check_tensor("recovery_noise", recovery_noise, 2, floats)
    batch = num_draft_tokens.shape[0]
    total = draft_token_ids.shape[0]
    vocab = target_probs.shape[1]
    if batch and int(num_draft_tokens.min()) < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens.tolist()}")
    if int(num_draft_tokens.sum()) != total:
        raise ValueError(f"num_draft_tokens sums to {int(num_draft_tokens.sum())} but there are {total} draft_token_ids")
    if target_probs.shape[0] != total:
        raise ValueError(f"target_probs must have one row per draft token ({total}), got {target_probs.shape[0]}")
    if vocab < 1:
        raise ValueError("target_probs must have a vocabulary of at least 1")
    for name, t, shape in (
        ("bonus_token_ids", bonus_token_ids, (batch,)),
        ("is_greedy", is_greedy, (batch,)),
        ("uniform_probs", uniform_probs, (total,)),
        ("recovery_noise", recovery_noise, (batch, vocab)),
    ):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if draft_probs is not None:
        _check_tensor("draft_probs", draft_probs, 2, floats)
        if tuple(draft_probs.shape) != (total, vocab):
            raise ValueError(f"draft_probs must have shape {(total, vocab)} like target_probs, got {tuple(draft_probs.shape)}")
        check_distribution("draft_probs", draft_probs)
    check_distribution("target_probs", target_probs)
    check_token_ids("draft_token_ids", draft_token_ids, vocab)
    check_token_ids("bonus_token_ids", bonus_token_ids, vocab)
    if total and (float(uniform_probs.min()) < 0 or float(uniform_probs.max()) >= 1):
        raise ValueError("uniform_probs must lie in [0, 1)")
    if recovery_noise.numel() and not (recovery_noise > 0).all():
        raise ValueError("recovery_noise must be strictly positive (Exp(1) draws)")
    max_k = int(num_draft_tokens.max()) if batch else 0
    return batch, vocab, max_k
