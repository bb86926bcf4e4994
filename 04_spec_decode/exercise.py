"""Chapter 4 exercise: write the heart of lossless speculative decoding.

Run the chapter's tests against this file with
    .venv/bin/pytest -q tests/test_ch4_*.py --impl=exercise
Start with `tests/test_ch4_examples.py`: each of its small cases names the
mistake it catches. Stuck? `04_spec_decode/HINTS.md` has hints in three
levels, from the idea to the last push before the solution; read only as much as
you need.

You write three functions:
- `recover_token`: the token emitted at a rejected draft position;
- `rejection_sample_request`: the verification of one request's drafts;
- `propose_ngram`: prompt-lookup drafts.
Everything else below is given: the batch loop around your per-request
function, the logits -> probabilities -> random draws pipeline
(`RejectionSamplerPipeline`), the proposers' plumbing and the verify-step
bookkeeping. Nothing here imports the modules that hold the answers
(`rejection_sampler.py`, `ngram_proposer.py`); in this exercise
`rejection_sample` (batched in the reference) is the same per-request loop,
so every test of the chapter runs your code.
vLLM counterparts: `vllm/v1/sample/rejection_sampler.py`, `vllm/v1/spec_decode/ngram_proposer.py`.
"""
from __future__ import annotations

import numpy as np  # noqa: F401  (for your propose_ngram)
import torch

from .metadata import SpecDecodeMetadata, apply_verify_step, num_accepted_from_output  # noqa: F401
from .proposers import NextTokenModelProposer, NgramProposerBase  # noqa: F401
from .random_draws import generate_exponential_noise, generate_uniform_probs  # noqa: F401
from .rejection_pipeline import PLACEHOLDER_TOKEN_ID, RejectionSamplerPipeline
from .sampling import TemperatureTopKTopP, apply_top_k_top_p_pytorch, logits_to_probs, sample_from_probs  # noqa: F401
from .validation import validate_rejection_inputs


def recover_token(target_probs, draft_probs, draft_token_id, noise) -> int:
    """The token emitted when draft `draft_token_id` is rejected at one position."""
    raise NotImplementedError(
        "recover_token(target_probs p [V], draft_probs q [V] or None, draft_token_id x, noise [V] of Exp(1) "
        "draws) -> an int in [0, V). q = None means an n-gram draft: a q that is one-hot on x. Contract: "
        "the token is a sample, driven by `noise` alone (the same noise gives the same token), from the "
        "recovery distribution: the one that, combined with rejection_sample_request's acceptance, makes "
        "the token emitted at this position distributed exactly as p (the notebook's §1 derives it). A "
        "token outside that distribution's support is never returned while the support is not empty; when "
        "it is empty (p equal to q up to rounding), sample p. Inputs are never modified. Exactness: tests "
        "compare tokens with the reference for the same noise, including distributions whose mass lies in "
        "float32's denormal range.")


def rejection_sample_request(draft_token_ids, draft_probs, target_probs, bonus_token_id, is_greedy,
                             uniform_probs, recovery_noise) -> list[int]:
    """Verify one request's k drafts; return the emitted tokens."""
    raise NotImplementedError(
        "rejection_sample_request(draft_token_ids: k ints, draft_probs [k, V] float32 or None (n-gram: "
        "one-hot q), target_probs [k, V], bonus_token_id int, is_greedy bool, uniform_probs [k] in [0, 1), "
        "recovery_noise [V]) -> list of 1 to k + 1 ints. Contract: the emitted tokens are the longest "
        "accepted prefix of the drafts, then exactly one more token: recover_token's at the first rejected "
        "position, or bonus_token_id when all k are accepted (k = 0 emits [bonus_token_id]). Greedy: every "
        "emitted token but the bonus is the target's most likely token at its position (torch.argmax's "
        "choice on ties), and the random inputs are not read. Random: the decision at position i reads "
        "uniform_probs[i] as its one random draw, and accepts iff the draw falls strictly below that "
        "draft's acceptance probability (so a draft the target gives probability 0 is never accepted, even "
        "at u = 0); which acceptance probability makes the output lossless is the notebook's §1. The "
        "output must be distributed exactly as the target's own samples (chi-square tests) and equal the "
        "reference's tokens for the same draws. Inputs are validated by the given batch loop.")


def propose_ngram(tokens, min_n, max_n, k, occurrence="earliest"):
    """Prompt lookup: up to k tokens that followed an earlier occurrence of the context's last n tokens."""
    raise NotImplementedError(
        "propose_ngram(tokens: sequence of ints, min_n, max_n, k, occurrence='earliest' | 'latest') -> list "
        "of at most k ints. Contract: a longer match wins (n from max_n down to min_n, n < len(tokens)); "
        "among matches of one n, the earliest or the latest start as `occurrence` says; the result is the "
        "tokens that followed that match (fewer than k if the context ends first), [] when nothing matches "
        "or k == 0. Linear in len(tokens) per n (tests use contexts of 100k tokens). Raise ValueError "
        "naming min_n unless 1 <= min_n <= max_n, naming k if k < 0, naming occurrence if it is neither "
        "value.")


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


class RejectionSampler(RejectionSamplerPipeline):
    """The given logits -> probabilities -> draws pipeline, verifying with your sampler
    (backends "reference" and "torch"; the Triton kernel is not part of the exercise)."""

    per_request_sampler = staticmethod(rejection_sample_reference)
    batched_sampler = staticmethod(rejection_sample_reference)


class NgramProposer(NgramProposerBase):
    """The given proposer plumbing around your `propose_ngram`."""

    _propose = staticmethod(propose_ngram)
