"""Chapter 4 exercise: write the heart of lossless speculative decoding.

Run the chapter's tests against this file with
    .venv/bin/pytest -q tests/test_ch4_*.py --impl=exercise
Start with `tests/test_ch4_examples.py`: each of its small cases names the
mistake it catches.

You write three functions:
- `recover_token`: the token emitted at a rejection, a sample from the
  RESIDUAL max(0, p - q), normalised (not from p);
- `rejection_sample_request`: the accept test and the walk over one request's
  drafts (greedy and random rules, stop at the first rejection, bonus token);
- `propose_ngram`: prompt-lookup drafts.
Everything else below is given: the batch loop around your per-request
function, the logits -> probabilities -> random draws pipeline
(`RejectionSampler`), proposers' plumbing and the verify-step bookkeeping.
In this exercise `rejection_sample` (batched in the reference) is the same
per-request loop, so every test of the chapter runs your code.
"""
from __future__ import annotations

import numpy as np  # noqa: F401  (for your propose_ngram)
import torch

from . import proposers as _proposers
from .metadata import SpecDecodeMetadata, apply_verify_step, num_accepted_from_output  # noqa: F401
from .proposers import DraftModelProposer  # noqa: F401
from .random_draws import generate_exponential_noise, generate_uniform_probs  # noqa: F401
from .rejection_sampler import PLACEHOLDER_TOKEN_ID
from .rejection_sampler import RejectionSampler as _GivenRejectionSampler
from .sampling import SamplingMetadata, apply_top_k_top_p, compute_probs, sample_from_probs  # noqa: F401
from .validation import validate_rejection_inputs


def recover_token(target_probs, draft_probs, draft_token_id, noise) -> int:
    """The token emitted when draft `draft_token_id` is rejected at one position.

    target_probs p [V], draft_probs q [V] or None (n-gram draft: q is one-hot on
    the draft), noise [V] of Exp(1) draws. Returns an int in [0, V).
    """
    raise NotImplementedError(
        "recover_token: residual = max(0, p - q) elementwise (torch.clamp(..., min=0)); without "
        "draft_probs q is one-hot on the draft, so residual = p with p[draft_token_id] set to 0 (on a copy). "
        "Sample it with the exponential race: int(argmax(residual / noise)) (no need to normalise). "
        "If the residual is all zero (p == q up to rounding), use p itself instead. (The reference also "
        "multiplies the residual by 2**64 so that a denormal residual's ratios do not round to 0.) Recovering from p "
        "when a residual exists is the classic lossy mistake; tests/test_ch4_examples.py checks it."
    )


def rejection_sample_request(draft_token_ids, draft_probs, target_probs, bonus_token_id, is_greedy,
                             uniform_probs, recovery_noise) -> list[int]:
    """Verify one request's k drafts; return the emitted tokens as a list of ints (1 to k + 1 of them).

    draft_token_ids: list of k ints; draft_probs [k, V] float32 or None (n-gram
    drafts); target_probs [k, V]; bonus_token_id int; is_greedy bool;
    uniform_probs [k] in [0, 1); recovery_noise [V] (Exp(1) draws). Inputs are
    already validated by the given batch loop.
    """
    raise NotImplementedError(
        "Walk positions i = 0..k-1 with draft x = draft_token_ids[i] and p = target_probs[i]. "
        "Greedy: accept while x == argmax(p); at the first mismatch emit int(argmax(p)) and stop "
        "(greedy ignores uniform_probs and the noise). Random: accept iff uniform_probs[i] * q(x) < p(x), "
        "STRICT '<' (so a token with p(x) = 0 is never accepted, even when u = 0), with q(x) = "
        "draft_probs[i, x], or 1 without draft_probs; at the first rejection emit "
        "recover_token(p, draft_probs[i] or None, x, recovery_noise) and stop: later drafts are discarded "
        "and no bonus token follows. Only if all k drafts are accepted append bonus_token_id. "
        "k = 0 emits [bonus_token_id]."
    )


def propose_ngram(tokens, min_n, max_n, k, occurrence="earliest"):
    """Prompt lookup: for n = max_n..min_n, find an earlier occurrence of the last n
    tokens (the earliest, as vLLM does, or the latest) and return up to k tokens that
    followed it ([] when nothing matches)."""
    raise NotImplementedError(
        "For n from max_n down to min_n (skip n >= len(tokens)), compare tokens[-n:] with every window "
        "tokens[i:i+n], i < len(tokens) - n (numpy sliding_window_view keeps this linear); take the "
        "smallest matching i for occurrence='earliest' (the default; on periodic text the latest match "
        "is one period back and runs out of context after one period) or the largest for "
        "occurrence='latest', and return tokens[i+n:i+n+k] as a list. k = 0 returns []. Raise "
        "ValueError naming min_n unless 1 <= min_n <= max_n, naming k if k < 0, and naming occurrence "
        "if it is neither 'earliest' nor 'latest'."
    )


# ---- given: the batch around your per-request function -------------------------------

def rejection_sample_reference(draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids,
                               is_greedy, uniform_probs, recovery_noise) -> torch.Tensor:
    """Your `rejection_sample_request` on each request; output [B, max_k + 1] int64, -1 padded."""
    batch, _, max_k = validate_rejection_inputs(draft_token_ids, num_draft_tokens, draft_probs, target_probs,
                                                bonus_token_ids, is_greedy, uniform_probs, recovery_noise)
    out = torch.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=target_probs.device)
    start = 0
    for b in range(batch):
        k = int(num_draft_tokens[b])
        rows = slice(start, start + k)
        tokens = rejection_sample_request(
            draft_token_ids[rows].tolist(), None if draft_probs is None else draft_probs[rows], target_probs[rows],
            int(bonus_token_ids[b]), bool(is_greedy[b]), uniform_probs[rows], recovery_noise[b])
        if not 1 <= len(tokens) <= k + 1:
            raise RuntimeError(f"rejection_sample_request returned {len(tokens)} tokens for {k} drafts ({tokens}): "
                               "a verify step emits 1..k+1 (stop at the first rejection; bonus only after k accepts)")
        out[b, :len(tokens)] = torch.tensor([int(t) for t in tokens], dtype=torch.int64, device=out.device)
        start += k
    return out


# The reference vectorises the batch; here the per-request loop stands in for it.
rejection_sample = rejection_sample_reference


class RejectionSampler(_GivenRejectionSampler):
    """The given logits -> probabilities -> draws pipeline, verifying with your sampler."""

    per_request_sampler = staticmethod(rejection_sample_reference)
    batched_sampler = staticmethod(rejection_sample_reference)


class NgramProposer(_proposers.NgramProposer):
    _propose = staticmethod(propose_ngram)
