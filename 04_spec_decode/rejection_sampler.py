"""The rejection sampler: verify k draft tokens against the target in one step.

vLLM counterpart: `vllm/v1/sample/rejection_sampler.py` (`rejection_sample`,
`PLACEHOLDER_TOKEN_ID`, `sample_recovered_tokens`).

Contract shared by `rejection_sample_reference` (per request, readable),
`rejection_sample` (batched PyTorch) and `mini_vllm.kernels.rejection_sampler`
(Triton). Inputs, with T = sum(num_draft_tokens), B = batch, V = vocab:

- draft_token_ids [T] int, request-major; num_draft_tokens [B] int (ragged, >= 0)
- draft_probs [T, V] float32, or None for drafts without probabilities (n-gram)
- target_probs [T, V] float32: processed target distribution at each draft position
- bonus_token_ids [B] int: the target's own sample after the last draft
- is_greedy [B] bool
- uniform_probs [T], recovery_noise [B, V]: pre-drawn randomness (random_draws.py)

Output [B, max_k + 1] int64: the emitted tokens, then PLACEHOLDER_TOKEN_ID (-1).

Rules per request, walking draft positions i = 0..k-1 with draft x = d_i:
- greedy: accept while x == argmax(p_i); at the first mismatch emit argmax(p_i), stop.
- random: accept iff u_i * q_i(x) < p_i(x), i.e. with probability min(1, p/q);
  without draft probs q_i is one-hot on x, so accept with probability p_i(x).
  At the first rejection emit argmax(residual * RESIDUAL_SCALE / noise) with
  residual = max(0, p_i - q_i) (a sample from the normalised residual), stop.
  If the residual is all zero (rounding; only then), recover from p_i instead.
  RESIDUAL_SCALE = 2**64 does not move the argmax (a power of two scales
  exactly) but lifts a denormal residual, whose plain ratio to the noise
  would round to 0 everywhere, into normal range; unlike a log-space argmax
  it keeps the three implementations bit-identical, and a GPU's log (which
  flushes denormals) never sees one.
- if every draft is accepted, emit bonus_token_ids[b] at position k.
So a request emits between 1 and k + 1 tokens; with k = 0 only the bonus.
"""
from __future__ import annotations

import torch

from .rejection_pipeline import PLACEHOLDER_TOKEN_ID, RejectionSamplerPipeline
from .validation import validate_rejection_inputs
# Exact power-of-two scale for the recovery race (see the module docstring):
# the smallest denormal times 2**64 over any Exp(1) draw stays a normal float,
# and 1 * 2**64 / noise overflows only for noise < 5e-20 (never, in practice).
# The Triton kernel uses the same constant.
RESIDUAL_SCALE = 2.0 ** 64


def recover_token(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_token_id: int, noise: torch.Tensor) -> int:
    """One sample from normalised max(0, p - q) via the exponential race (one position)."""
    if draft_probs is None:
        residual = target_probs.clone()
        residual[draft_token_id] = 0.0
    else:
        residual = torch.clamp(target_probs - draft_probs, min=0.0)
    if float(residual.max()) <= 0.0:
        residual = target_probs
    return int((residual * RESIDUAL_SCALE / noise).argmax())


def rejection_sample_request(
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_id: int,
    is_greedy: bool,
    uniform_probs: torch.Tensor,
    recovery_noise: torch.Tensor,
) -> list[int]:
    """Verify one request's drafts; return the emitted tokens (1 to k + 1 of them).

    draft_probs/target_probs [k, V], uniform_probs [k], recovery_noise [V].
    """
    out: list[int] = []
    for i, x in enumerate(draft_token_ids):
        p = target_probs[i]
        if is_greedy:
            best = int(p.argmax())
            if x != best:
                return out + [best]
        else:
            q_x = 1.0 if draft_probs is None else draft_probs[i, x]
            # Strict `<` so that p(x) == 0 can never be accepted, even with u == 0.
            if not bool(uniform_probs[i] * q_x < p[x]):
                q = None if draft_probs is None else draft_probs[i]
                return out + [recover_token(p, q, x, recovery_noise)]
        out.append(int(x))
    return out + [int(bonus_token_id)]


def rejection_sample_reference(
    draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_noise,
    sample_request=None,
) -> torch.Tensor:
    """Per-request loop over `rejection_sample_request`; output [B, max_k + 1] with -1 padding.

    `sample_request` swaps in another per-request function (the exercise's).
    """
    sample_request = sample_request or rejection_sample_request
    batch, _, max_k = validate_rejection_inputs(
        draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_noise
    )
    out = torch.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=target_probs.device)
    start = 0
    for b in range(batch):
        k = int(num_draft_tokens[b])
        sl = slice(start, start + k)
        tokens = sample_request(
            draft_token_ids[sl].tolist(),
            None if draft_probs is None else draft_probs[sl],
            target_probs[sl],
            int(bonus_token_ids[b]),
            bool(is_greedy[b]),
            uniform_probs[sl],
            recovery_noise[b],
        )
        out[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64, device=out.device)
        start += k
    return out


def rejection_sample(
    draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_noise
) -> torch.Tensor:
    """Batched, vectorised version of `rejection_sample_reference` (same output, same draws).

    Every draft position is judged at once; the first rejection of each request
    is found with an argmax over the [B, max_k] reject grid, everything after
    it is masked, and the residual is sampled only at that one position.
    """
    batch, vocab, max_k = validate_rejection_inputs(
        draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids, is_greedy, uniform_probs, recovery_noise
    )
    device = target_probs.device
    num_draft_tokens = num_draft_tokens.to(device=device, dtype=torch.int64)
    total = draft_token_ids.shape[0]
    out = torch.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    if batch == 0:
        return out
    drafts = draft_token_ids.to(device=device, dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(batch, device=device), num_draft_tokens)
    starts = torch.cumsum(num_draft_tokens, 0) - num_draft_tokens
    pos = torch.arange(total, device=device) - starts[req]
    greedy_tok = is_greedy.to(device)[req]

    # Accept decision per draft token.
    # Argmax only where a greedy request needs it (a full pass over V per row).
    if bool(greedy_tok.all()):
        # All greedy: argmax in place (no [T, V] row copy); p(x), q(x), u unused.
        target_argmax = target_probs.argmax(dim=-1)
        accepted = drafts == target_argmax
    else:
        target_argmax = torch.full_like(drafts, PLACEHOLDER_TOKEN_ID)
        greedy_rows = torch.nonzero(greedy_tok).squeeze(1)
        target_argmax[greedy_rows] = target_probs[greedy_rows].argmax(dim=-1)
        p_x = target_probs.gather(1, drafts[:, None]).squeeze(1)
        if draft_probs is None:
            q_x = torch.ones_like(p_x)
        else:
            q_x = draft_probs.gather(1, drafts[:, None]).squeeze(1)
        accepted = torch.where(greedy_tok, drafts == target_argmax, uniform_probs.to(device) * q_x < p_x)

    # Lay accept decisions out as [B, max_k]; padding slots count as accepted so
    # they never look like a first rejection.
    acc = torch.ones(batch, max_k, dtype=torch.bool, device=device)
    acc[req, pos] = accepted
    rejected = ~acc
    has_rej = rejected.any(dim=1)
    first_idx = rejected.int().argmax(dim=1) if max_k else torch.zeros_like(num_draft_tokens)
    first_rej = torch.where(has_rej, first_idx, num_draft_tokens)  # in [0, k]

    # Accepted drafts before the first rejection.
    grid_draft = torch.full((batch, max_k), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    grid_draft[req, pos] = drafts
    cols = torch.arange(max_k, device=device)[None, :]
    out[:, :max_k] = torch.where(cols < first_rej[:, None], grid_draft, out[:, :max_k])

    # Recovered token at each request's first rejected position: a greedy
    # request emits the target argmax it already has; a random one samples the
    # residual, computed only for those rows (at most B of the T rows).
    rows = torch.nonzero(has_rej).squeeze(1)
    t = starts[rows] + first_rej[rows]
    recovered = target_argmax[t]
    rnd = torch.nonzero(~greedy_tok[t]).squeeze(1)
    rows_r, t_r = rows[rnd], t[rnd]
    p = target_probs[t_r]
    if draft_probs is not None:
        residual = (p - draft_probs[t_r]).clamp_(min=0.0)
    else:
        residual = p.clone()
        residual[torch.arange(t_r.numel(), device=device), drafts[t_r]] = 0.0
    noise = recovery_noise[rows_r]
    pick = (residual * RESIDUAL_SCALE / noise).argmax(dim=-1)
    # An all-zero residual (rounding; only then) makes every ratio 0, so the
    # pick lands on a zero entry: recover from p instead, as the reference does.
    # (Scaled, a positive residual never gives a zero ratio, so the pick is
    # on a zero entry only when the whole residual is zero.)
    empty = torch.nonzero(residual.gather(1, pick[:, None]).squeeze(1) <= 0.0).squeeze(1)
    if empty.numel():
        pick[empty] = (p[empty] * RESIDUAL_SCALE / noise[empty]).argmax(dim=-1)
    recovered[rnd] = pick
    out[rows, first_rej[rows]] = recovered

    # Bonus token where every draft was accepted.
    full = torch.nonzero(~has_rej).squeeze(1)
    out[full, num_draft_tokens[full]] = bonus_token_ids.to(device=device, dtype=torch.int64)[full]
    return out


def rejection_sample_triton_checked(*args) -> torch.Tensor:
    """The Triton kernel (`mini_vllm.kernels.rejection_sampler`) after the same input checks."""
    from mini_vllm.kernels import prepare_triton

    prepare_triton()  # without CUDA: Triton's interpreter, selected before triton is imported
    from mini_vllm.kernels.rejection_sampler import rejection_sample_triton

    validate_rejection_inputs(*args)
    return rejection_sample_triton(*args)


class RejectionSampler(RejectionSamplerPipeline):
    """End-to-end verify step: logits in, emitted tokens out (vLLM's `RejectionSampler.forward`).

    backend: "reference" (per-request loop), "torch" (batched) or "triton".
    """

    per_request_sampler = staticmethod(rejection_sample_reference)
    batched_sampler = staticmethod(rejection_sample)
    triton_sampler = staticmethod(rejection_sample_triton_checked)
