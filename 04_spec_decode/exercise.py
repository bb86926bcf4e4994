"""Chapter 4 exercise: write the per-request rejection sampler and the n-gram proposer.

Run the chapter's tests against this file with
    .venv/bin/python -m pytest -q tests/test_ch4_*.py --impl=exercise
Everything else is re-exported from the reference, so only your two functions
are under test. Read `rejection_sampler.py`'s module docstring for the rules.
"""
from __future__ import annotations

import functools

from . import proposers as _proposers
from . import rejection_sampler as _rs
from .metadata import SpecDecodeMetadata, apply_verify_step, num_accepted_from_output  # noqa: F401
from .proposers import DraftModelProposer  # noqa: F401
from .random_draws import generate_exponential_noise, generate_uniform_probs  # noqa: F401
from .rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler, recover_token, rejection_sample  # noqa: F401
from .sampling import SamplingMetadata, apply_top_k_top_p, compute_probs, sample_from_probs  # noqa: F401
from .validation import validate_rejection_inputs  # noqa: F401


def rejection_sample_request(draft_token_ids, draft_probs, target_probs, bonus_token_id, is_greedy, uniform_probs, recovery_noise):
    """Verify one request's k drafts; return the emitted tokens (1 to k + 1 of them).

    draft_probs [k, V] or None (n-gram drafts), target_probs [k, V], uniform_probs [k],
    recovery_noise [V] (Exp(1) draws).
    """
    raise NotImplementedError(
        "Walk the drafts in order. Greedy: accept while the draft equals argmax(target_probs[i]); "
        "on a mismatch emit that argmax and stop. Random: accept iff uniform_probs[i] * q(x) < p(x) "
        "(q(x) = 1 without draft_probs); on rejection emit recover_token(p, q_or_None, x, recovery_noise) "
        "and stop. If nothing was rejected, append bonus_token_id."
    )


def propose_ngram(tokens, min_n, max_n, k):
    """Prompt lookup: for n = max_n..min_n, find the most recent earlier occurrence of the
    last n tokens and return up to k tokens that followed it ([] when nothing matches)."""
    raise NotImplementedError(
        "For n from max_n down to min_n, compare tokens[-n:] with every window tokens[i:i+n], "
        "i < len(tokens) - n (numpy sliding_window_view keeps this linear); take the largest "
        "matching i and return tokens[i+n:i+n+k]. Validate 1 <= min_n <= max_n and k >= 0."
    )


rejection_sample_reference = functools.partial(_rs.rejection_sample_reference, sample_request=rejection_sample_request)


class NgramProposer(_proposers.NgramProposer):
    _propose = staticmethod(propose_ngram)
