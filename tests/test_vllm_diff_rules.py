"""The comparison rules of `benchmarks/vllm_diff.py` that gate every side-by-side
benchmark: a near-tie in vLLM's top-2 ends the compared prefix, and logprobs agree
within a tolerance, both set per precision (fp32 defaults, bf16 wider)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from vllm_diff import (BF16_LOGPROB_TOL, BF16_TIE_MARGIN, LOGPROB_TOL, TIE_MARGIN,  # noqa: E402
                       compare_completion)

# Three positions; vLLM's top-2 margin is 0.5, then 0.02 (a bf16 near-tie, not an fp32 one), then 0.5.
WANT = {"token_ids": [5, 6, 7],
        "logprobs": [[(5, -0.1, 1), (9, -0.6, 2)], [(6, -0.70, 1), (8, -0.72, 2)], [(7, -0.2, 1), (3, -0.7, 2)]]}


def got(tokens, lp_shift=0.0):
    rows = [[(t, lp + lp_shift, r) for t, lp, r in row] for row in WANT["logprobs"]]
    return {"token_ids": tokens, "logprobs": rows}


def test_a_bf16_near_tie_ends_the_compared_prefix_only_under_the_bf16_margin():
    assert TIE_MARGIN < 0.02 < BF16_TIE_MARGIN, "the example's tie must be one for bf16 and not for fp32"
    n, total, problems = compare_completion(WANT, got([5, 8, 1]), "r", margin=BF16_TIE_MARGIN)
    assert (n, total, problems) == (1, 3, []), \
        f"bf16: a swap at vLLM's 0.02-margin near-tie must end the comparison, got {(n, total, problems)}"
    n, _, problems = compare_completion(WANT, got([5, 8, 1]), "r")
    assert problems and "token 1" in problems[0], \
        f"fp32: a 0.02 margin is no tie, so the swapped token must be reported, got {problems}"


def test_logprobs_within_the_tolerance_of_their_precision():
    shift = 10 * LOGPROB_TOL
    assert shift < BF16_LOGPROB_TOL, "the example's shift must fit the bf16 tolerance"
    _, _, problems = compare_completion(WANT, got([5, 6, 7], shift), "r", top_k=1)
    assert problems, f"fp32: logprobs {shift} apart must be reported (tolerance {LOGPROB_TOL})"
    _, _, problems = compare_completion(WANT, got([5, 6, 7], shift), "r", top_k=1, margin=0.0,
                                        tol=BF16_LOGPROB_TOL)
    assert not problems, f"bf16: logprobs {shift} apart are within {BF16_LOGPROB_TOL}, got {problems}"
