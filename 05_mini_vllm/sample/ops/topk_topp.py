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

Cost: no full sort in the common case. `torch.topk` takes each row's largest
C logits (C = largest k + 1, or TOP_P_CANDIDATES for top-p alone) and both
cuts are found inside them; only a row whose nucleus is wider than C takes
more (8x per retry, a full sort at worst). The kept set is "logit >= a threshold", so nothing is scattered back.
The candidates also let the sampler race C tokens instead of V
(`random_sample_candidates`). min-p needs one max per row.
"""
from __future__ import annotations

import torch

# Exp(1) noise is clamped away from 0 so p / noise is never 0 / 0 (NaN).
_MIN_NOISE = torch.finfo(torch.float32).tiny
# Candidates taken for a top-p row without top-k: a peaked distribution's
# nucleus fits; a flatter one retries that row with 8x more.
TOP_P_CANDIDATES = 1024


def _check_rows(name: str, t: torch.Tensor, logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if t.shape != (logits.shape[0],):
        raise ValueError(f"{name} must have shape ({logits.shape[0]},), one value per row, got {tuple(t.shape)}")


def _prefix_cut(values: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Number of leading entries of descending `values` [B, C] that top-p keeps.

    Token j is kept iff the mass before it, sum_{i<j} exp(values_i - log_norm),
    is < top_p. One cumsum makes that mass monotone, so the kept set is a prefix
    (which always holds entry 0). top_p == 1 keeps all: rounding could push the
    prefix sum to 1 before the tail.
    """
    cum = (values - log_norm).exp().cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    keep = (mass_before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    keep[:, 0] = True
    return keep.sum(dim=1)


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None):
    """(masked logits [B, V], candidates) for `apply_top_k_top_p`.

    candidates is None when there is no filter, else (values [B, C] with
    dropped entries -inf, token ids [B, C], complete [B] bool); complete[b]
    guarantees that every token row b keeps is among its C candidates, so a
    sampler may race those C tokens instead of all V.
    How: C = the batch's largest k + 1, at least TOP_P_CANDIDATES when a row has
    top-p without top-k. `torch.topk(C)` gives each row's C largest logits
    sorted; top-k and top-p cut inside them. A row whose top-p cut reaches
    past C (a flat distribution) retries alone with 8x more, up to a full sort;
    its `complete` is then False (the sampler races all V tokens).
    """
    batch, vocab = logits.shape
    if top_k is None and top_p is None:
        return logits.clone(), None
    device = logits.device
    k = torch.zeros(batch, dtype=torch.int64, device=device) if top_k is None else top_k.to(device, torch.int64)
    p = torch.ones(batch, dtype=logits.dtype, device=device) if top_p is None else top_p.to(device, logits.dtype)
    k_on, p_on = (k > 0) & (k < vocab), p < 1.0
    if not bool((k_on | p_on).any()):
        return logits.clone(), None
    # +1: a row whose kept set ends before the last candidate provably has no
    # kept token outside the candidates.
    c = int(k[k_on].max()) + 1 if bool(k_on.any()) else 1
    if bool((p_on & ~k_on).any()):
        c = max(c, TOP_P_CANDIDATES)
    c = min(c, vocab)
    values, ids = logits.topk(c, dim=-1)
    kth = values.gather(1, (torch.where(k_on, k, 1) - 1).unsqueeze(1))
    kth = kth.masked_fill(~k_on.unsqueeze(1), float("-inf"))  # [B, 1]; ties with it stay
    masked = logits.masked_fill(logits < kth, float("-inf"))
    threshold = kth
    if bool(p_on.any()):
        # top-p renormalises over what top-k kept: log of that mass, one pass.
        log_norm = masked.logsumexp(dim=-1, keepdim=True)
        top = values.masked_fill(values < kth, float("-inf"))
        n_keep = _prefix_cut(top, log_norm, p)
        cut = torch.maximum(top.gather(1, (n_keep - 1).unsqueeze(1)), kth)
        threshold = torch.where(p_on.unsqueeze(1), cut, kth)
        unsure = torch.nonzero(p_on & (n_keep == c) & (c < vocab)).squeeze(1)
        wider = c
        while unsure.numel():  # the cut may lie past the candidates: 8x more for those rows
            wider = min(wider * 8, vocab)
            rows = masked[unsure].topk(wider, dim=-1).values
            n_rows = _prefix_cut(rows, log_norm[unsure], p[unsure])
            threshold[unsure] = rows.gather(1, (n_rows - 1).unsqueeze(1))
            unsure = unsure[(n_rows == wider) & (wider < vocab)]
        masked = masked.masked_fill(masked < threshold, float("-inf"))
    complete = (values >= threshold).sum(dim=1) < c if c < vocab else torch.ones(batch, dtype=torch.bool, device=device)
    return masked, (values.masked_fill(values < threshold, float("-inf")), ids, complete)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits [B, V] outside each row's top-k and top-p sets with -inf.

    top_k [B] int (0/-1 disable) or None; top_p [B] float (1 disables) or None.
    Returns a new tensor; `logits` is not modified.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if top_k is not None:
        _check_rows("top_k", top_k, logits)
    if top_p is not None:
        _check_rows("top_p", top_p, logits)
    return top_k_top_p_filter(logits, top_k, top_p)[0]


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
    """Exp(1) noise [B, V] as -log(U), U ~ Uniform[0, 1): unseeded rows in one draw
    on the global RNG, seeded row i from generators[i] alone (`_seeded_row_noise`),
    so a seeded row never depends on the batch.

    Why not `Tensor.exponential_`: on a CPU it draws each value with a scalar
    logarithm, 10.8 ms for 100 rows of 6,144 (one thread), against 1.9 ms for a
    vectorised uniform draw and `log_`. A uniform of 24 random bits makes -log(U)
    take one of 2**24 values, so an outcome's probability can move by about 1e-7,
    far below what a sample can show."""
    batch, vocab = shape
    noise = torch.empty(batch, vocab, dtype=torch.float32, device=device)
    if len(generators) < batch:
        _exp1_(noise)
    for i, g in generators.items():
        noise[i] = _seeded_row_noise(g, vocab, device)
    return noise.clamp_(min=_MIN_NOISE)


def _exp1_(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill t with Exp(1) draws, -log(U) for U ~ Uniform[0, 1) (see `exponential_noise`); returns t."""
    return t.uniform_(generator=generator).log_().neg_()


def _seeded_row_noise(g: torch.Generator, vocab: int, device) -> torch.Tensor:
    """One seeded row's V noises, computed alone (the same bits on every path:
    a vectorised log over a longer buffer may round a row's tail differently)."""
    return _exp1_(torch.empty(vocab, dtype=torch.float32, device=device), g)


def random_sample(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row from softmax(logits) by the exponential race argmax(p / E).

    P(argmax = v) = p_v, so this is exact categorical sampling. p need not be
    normalised for an argmax, so exp(l - max) stands in for the softmax.
    """
    unnorm = (logits - logits.max(dim=-1, keepdim=True).values).exp_()
    noise = exponential_noise(tuple(logits.shape), generators, logits.device)
    return unnorm.div_(noise).argmax(dim=-1)



def random_sample_candidates(values: torch.Tensor, ids: torch.Tensor, generators: dict[int, torch.Generator],
                             vocab: int) -> torch.Tensor:
    """`random_sample` restricted to candidates: values [B, C] (dropped: -inf), ids [B, C].

    Valid only when every kept token is a candidate; then the other tokens have
    p = 0 and cannot win the race. Unseeded rows draw C noises, not V. A seeded
    row draws its full V-entry stream, exactly as `random_sample` does, and
    reads it at its candidates' ids, so it gets the same token on either path.
    """
    batch, c = values.shape
    noise = torch.empty(batch, c, dtype=torch.float32, device=values.device)
    if len(generators) < batch:
        _exp1_(noise)
    for i, g in generators.items():
        noise[i] = _seeded_row_noise(g, vocab, values.device)[ids[i]]
    noise.clamp_(min=_MIN_NOISE)
    unnorm = (values - values.max(dim=-1, keepdim=True).values).exp_()
    pick = unnorm.div_(noise).argmax(dim=-1, keepdim=True)
    return ids.gather(1, pick).squeeze(1)
