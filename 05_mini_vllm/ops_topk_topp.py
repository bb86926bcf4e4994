"""Logit filters and the random draw of the engine's sampler.

vLLM counterpart: `vllm/v1/sample/ops/topk_topp_sampler.py` (top-k/top-p and
`random_sample`) and the min-p logits processor in `vllm/v1/sample/logits_processor`.

Every filter returns logits in which the dropped tokens are -inf; each row is
filtered with its own parameter. Semantics (invariants the tests pin down):

- top-k keeps every token whose logit is >= the k-th largest logit of its row,
  so tokens tied with the k-th one are all kept (the result never depends on
  how a sort orders equal values). k == 0, k == -1 or k >= vocab disables it.
- top-p is computed on the top-k-filtered, renormalised distribution. A token
  is kept iff the probability mass of the tokens *strictly more likely* than
  it is < top_p: the smallest prefix reaching top_p, again with ties kept
  together. top_p == 1 disables it.
- min-p keeps a token iff p(token) >= min_p * max_p of its row; min_p == 0
  disables it.
- The most likely token always survives every filter, so every row stays a
  distribution.

Cost: top-k alone uses `torch.topk` with the largest k of the batch, never a
full sort; only top-p sorts (values only: the kept set is "logit >= a
threshold", so nothing is scattered back). min-p needs one max per row.
"""
from __future__ import annotations

import torch

# Exp(1) noise is clamped away from 0 so p / noise is never 0 / 0 (NaN).
_MIN_NOISE = torch.finfo(torch.float32).tiny


def _check_rows(name: str, t: torch.Tensor, logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if t.shape != (logits.shape[0],):
        raise ValueError(f"{name} must have shape ({logits.shape[0]},), one value per row, got {tuple(t.shape)}")


def _top_k_threshold(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[B, 1] threshold: the k-th largest logit per row, -inf where top-k is disabled."""
    vocab = logits.shape[1]
    k = top_k.to(device=logits.device, dtype=torch.int64)
    enabled = (k > 0) & (k < vocab)
    if not bool(enabled.any()):
        return torch.full((logits.shape[0], 1), float("-inf"), device=logits.device)
    k = torch.where(enabled, k, 1)
    # topk with the batch's largest k (usually << vocab) instead of a full sort.
    values = logits.topk(int(k.max()), dim=-1).values
    kth = values.gather(1, (k - 1).unsqueeze(1))
    return kth.masked_fill(~enabled.unsqueeze(1), float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits [B, V] outside each row's top-k and top-p sets with -inf.

    top_k [B] int (0/-1 disable) or None; top_p [B] float (1 disables) or None.
    Returns a new tensor; `logits` is not modified.
    """
    if top_k is not None:
        _check_rows("top_k", top_k, logits)
    if top_p is not None:
        _check_rows("top_p", top_p, logits)
    if top_k is None and top_p is None:
        return logits.clone()
    if top_p is None:
        return logits.masked_fill(logits < _top_k_threshold(logits, top_k), float("-inf"))

    sorted_logits = logits.sort(dim=-1, descending=True).values
    if top_k is not None:
        vocab = logits.shape[1]
        k = top_k.to(device=logits.device, dtype=torch.int64)
        k = torch.where((k > 0) & (k < vocab), k, vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Exclusive prefix sum: mass of the tokens sorted before each one. Built
    # from one cumsum so it is monotone and the kept set is a prefix.
    cum = probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    top_p = top_p.to(device=logits.device, dtype=probs.dtype).unsqueeze(1)
    # top_p == 1 keeps all: rounding could push the prefix sum to 1 before the tail.
    keep = (mass_before < top_p) | (top_p >= 1.0)
    keep[:, 0] = True
    # The kept prefix ends at a threshold value; comparing against it keeps ties.
    last = keep.sum(dim=1, keepdim=True) - 1
    threshold = sorted_logits.gather(1, last)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with p < min_p * max_p (per row) with -inf; min_p [B], 0 disables.

    Done in log space, p_v / p_max = exp(l_v - l_max), so no softmax is needed.
    Returns a new tensor; `logits` is not modified.
    """
    _check_rows("min_p", min_p, logits)
    min_p = min_p.to(device=logits.device, dtype=logits.dtype)
    # log(0) = -inf: a disabled row keeps everything.
    log_min_p = torch.where(min_p > 0, min_p.clamp(min=1e-38).log(), float("-inf"))
    row_max = logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits < row_max + log_min_p.unsqueeze(1), float("-inf"))


def exponential_noise(shape: tuple[int, int], generators: dict[int, torch.Generator], device) -> torch.Tensor:
    """Exp(1) noise [B, V]: unseeded rows in one call on the global RNG, seeded
    row i from generators[i] alone, so a seeded row never depends on the batch."""
    batch, vocab = shape
    noise = torch.empty(batch, vocab, dtype=torch.float32, device=device)
    if len(generators) < batch:
        noise.exponential_()
    for i, g in generators.items():
        noise[i].exponential_(generator=g)
    return noise.clamp_(min=_MIN_NOISE)


def random_sample(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row from softmax(logits) by the exponential race argmax(p / E).

    P(argmax = v) = p_v, so this is exact categorical sampling. p need not be
    normalised for an argmax, so exp(l - max) stands in for the softmax.
    """
    unnorm = (logits - logits.max(dim=-1, keepdim=True).values).exp_()
    noise = exponential_noise(tuple(logits.shape), generators, logits.device)
    return unnorm.div_(noise).argmax(dim=-1)

