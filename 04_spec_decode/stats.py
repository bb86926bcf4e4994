"""The statistical check behind "lossless": does each emitted position follow p?

No vLLM counterpart (vLLM tests this in `tests/v1/sample/test_rejection_sampler.py`).

Setting: a verify step with target distributions p_0..p_k (k draft positions
plus the bonus position) that do not depend on earlier tokens, drafts x_i ~ q_i,
repeated over N independent requests. Reaching position i depends only on the
draws at positions < i, so among the requests that emit a token at position i,
that token must be distributed exactly as p_i when the sampler is lossless.

Test: Pearson's chi-square goodness of fit per position, against the exact p_i.
Bins whose expected count is below MIN_EXPECTED are pooled into one bin (the
chi-square approximation needs about 5 per bin); a token with p_i = 0 that is
emitted at all gives p-value 0. The p-value is the chi-square survival function
Q(df/2, x/2) (`torch.special.gammaincc`), so no scipy is needed. A caller fixes
a family-wise false-positive rate alpha and rejects when any position's p-value
is below alpha / (number of positions tested): Bonferroni.
"""
from __future__ import annotations

import torch

MIN_EXPECTED = 5.0
# Positions reached by fewer requests than this are not tested (too little data).
MIN_SAMPLES = 100


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of "tokens [n] are i.i.d. draws from probs [V]"."""
    n, vocab = tokens.numel(), probs.numel()
    observed = torch.bincount(tokens.reshape(-1), minlength=vocab).double()
    expected = probs.double() * n
    if observed[probs == 0].sum() > 0:
        return 0.0  # a token the target never emits came out: certainly lossy
    big = expected >= MIN_EXPECTED
    obs = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    df = obs.numel() - 1
    if df < 1:
        return 1.0  # a single bin: nothing to test
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def position_pvalues(output: torch.Tensor, target_probs: torch.Tensor) -> list[float]:
    """p-value per emitted position of a batch of identical requests.

    output [N, k + 1] from the sampler (-1 after the first rejection);
    target_probs [k + 1, V], the last row being the bonus distribution.
    Positions reached by fewer than MIN_SAMPLES requests are skipped.
    """
    pvals = []
    for i in range(output.shape[1]):
        col = output[:, i]
        col = col[col != -1]
        if col.numel() >= MIN_SAMPLES:
            pvals.append(chi_square_pvalue(col, target_probs[i]))
    return pvals


def passes_lossless_test(output: torch.Tensor, target_probs: torch.Tensor, alpha: float) -> bool:
    """True unless some position is rejected at family-wise level alpha (Bonferroni)."""
    pvals = position_pvalues(output, target_probs)
    return all(p >= alpha / max(len(pvals), 1) for p in pvals)


def simulate_identical_requests(target_probs, draft_probs, n, sampler, generator, draft_mode="sample"):
    """Run `sampler` (rejection_sample's signature) on n copies of one random request.

    target_probs [k + 1, V] (last row: bonus), draft_probs [k, V].
    draft_mode: "sample" draws x_i ~ q_i (the correct experiment); "argmax"
    fixes x_i = argmax q_i (the seed blog's mistake: the draft is then not a
    sample from q, so even a correct sampler need not reproduce p); "no_probs"
    fixes x_i = argmax q_i and passes no draft probabilities (n-gram style,
    lossless for any fixed draft). Returns the output [n, k + 1].
    """
    k, vocab = draft_probs.shape
    g = generator
    if draft_mode == "sample" and k:
        drafts = torch.multinomial(draft_probs, n, replacement=True, generator=g).T.reshape(-1)
    else:
        drafts = draft_probs.argmax(-1).repeat(n) if k else torch.zeros(0, dtype=torch.int64)
    bonus = torch.multinomial(target_probs[k], n, replacement=True, generator=g)
    return sampler(
        drafts,
        torch.full((n,), k, dtype=torch.int64),
        None if draft_mode == "no_probs" else draft_probs.repeat(n, 1),
        target_probs[:k].repeat(n, 1),
        bonus,
        torch.zeros(n, dtype=torch.bool),
        torch.rand(n * k, generator=g),
        torch.empty(n, vocab).exponential_(generator=g).clamp_(min=torch.finfo(torch.float32).tiny),
    )
