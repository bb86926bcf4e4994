"""Random draws for verification, made *before* the sampler runs.

vLLM counterpart: `generate_uniform_probs` in `vllm/v1/sample/rejection_sampler.py`
(and the exponential noise its `sample_recovered_tokens` draws).

Every rejection-sampler implementation in the course (per-request reference,
batched PyTorch, Triton kernel) consumes the same three tensors, so they can be
compared token for token:

- `uniform_probs [num_draft_tokens_total]`: one U[0, 1) per draft token, for
  the accept test `u * q(x) < p(x)`.
- `recovery_noise [batch, vocab]`: Exp(1) per request and vocabulary entry;
  the recovered token is `argmax(residual * 2**64 / noise)` (the exact scale
  keeps denormal residuals). One row per request
  suffices because only the *first* rejection of a request is ever emitted.
- `bonus_noise [batch, vocab]`: same kind of noise for the bonus token.

Seeded requests draw from their own `torch.Generator` (dict: request index ->
generator) in a fixed order (uniforms, recovery noise, bonus noise), so their
draws depend only on their own state, never on batch neighbours. Unseeded
requests share the global RNG. A generator keyed outside [0, batch) is a
ValueError in both draw functions.
"""
from __future__ import annotations

import operator

import torch

# Exp(1) draws are clamped away from 0 so that `residual / noise` is never 0/0.
_MIN_NOISE = torch.finfo(torch.float32).tiny


def _check_generator_keys(generators: dict | None, batch_size: int) -> None:
    """Both draw functions reject a generator keyed outside the batch: it
    would otherwise be silently ignored (its request's draws unseeded)."""
    for i in generators or {}:
        try:
            ok = not isinstance(i, bool) and 0 <= operator.index(i) < batch_size
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"generator key {i!r} must be a request index in [0, {batch_size})")


def generate_uniform_probs(num_draft_tokens, generators: dict | None = None, device="cpu") -> torch.Tensor:
    """U[0, 1) float32 draws, one per draft token, request-major like the drafts."""
    num_draft_tokens = [int(n) for n in num_draft_tokens]
    _check_generator_keys(generators, len(num_draft_tokens))
    out = torch.rand(sum(num_draft_tokens), dtype=torch.float32, device=device)
    start = 0
    for i, n in enumerate(num_draft_tokens):
        if generators and i in generators and n > 0:
            out[start : start + n] = torch.rand(n, dtype=torch.float32, generator=generators[i], device=device)
        start += n
    return out


def generate_exponential_noise(batch_size: int, vocab_size: int, generators: dict | None = None, device="cpu") -> torch.Tensor:
    """Exp(1) float32 noise [batch, vocab], strictly positive."""
    _check_generator_keys(generators, batch_size)
    out = torch.empty(batch_size, vocab_size, dtype=torch.float32, device=device).exponential_()
    for i, g in (generators or {}).items():
        out[i].exponential_(generator=g)
    return out.clamp_(min=_MIN_NOISE)


def random_verify_batch(num_draft_tokens, vocab_size: int, is_greedy, with_draft_probs: bool, generator: torch.Generator,
                        peaked: float = 2.0, draft_jitter: float | None = None) -> tuple:
    """A synthetic verify batch for tests and benchmarks, in the shared argument order.

    Probabilities are softmax(peaked * N(0, 1)) rows (with draft_jitter, the
    draft logits are the target's plus draft_jitter * N(0, 1), so the two
    mostly agree, as a good draft model does); drafts are sampled from
    the draft rows (or uniformly when there are none); every draw comes from
    `generator`. Returns (draft_token_ids, num_draft_tokens, draft_probs,
    target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_noise).
    """
    g = generator
    num = torch.as_tensor(list(num_draft_tokens), dtype=torch.int64)
    batch, total = num.shape[0], int(num.sum())
    target_logits = peaked * torch.randn(total, vocab_size, generator=g)
    target = torch.softmax(target_logits, dim=-1)
    if draft_jitter is None:
        draft = torch.softmax(peaked * torch.randn(total, vocab_size, generator=g), dim=-1)
    else:
        draft = torch.softmax(target_logits + draft_jitter * torch.randn(total, vocab_size, generator=g), dim=-1)
    if total:
        drafts = torch.multinomial(draft, 1, generator=g).squeeze(1)
    else:
        drafts = torch.zeros(0, dtype=torch.int64)
    bonus = torch.randint(0, vocab_size, (batch,), generator=g)
    uniform = torch.rand(total, generator=g)
    noise = torch.empty(batch, vocab_size).exponential_(generator=g).clamp_(min=_MIN_NOISE)
    greedy = torch.as_tensor(list(is_greedy), dtype=torch.bool).reshape(batch)
    return drafts, num, draft if with_draft_probs else None, target, bonus, greedy, uniform, noise
