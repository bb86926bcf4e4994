"""Chapter 4: the rejection sampler is lossless, and the test that says so has power.

Statistical test (see mini_vllm.spec_decode.stats): N identical requests with
drafts x_i ~ q_i; at every position reached by >= 100 requests, Pearson's
chi-square of the emitted tokens against the exact target row p_i. The
family-wise false-positive rate per hypothesis example is ALPHA = 1e-5
(Bonferroni over the <= 5 positions), so 25 examples flake with probability
<= 2.5e-4 per run. The measured rate is in benchmarks/bench_ch4_lossless_fpr.py.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mini_vllm.spec_decode import lossy
from mini_vllm.spec_decode.stats import passes_lossless_test, position_pvalues, simulate_identical_requests

ALPHA = 1e-5
N = 10_000


@st.composite
def target_and_draft(draw, max_vocab=16, max_k=4):
    """p [k+1, V] and q [k, V] from hypothesis weights, zeros included (tokens a side never proposes)."""
    vocab = draw(st.integers(2, max_vocab))
    k = draw(st.integers(0, max_k))
    weight = st.one_of(st.just(0.0), st.floats(0.05, 10.0))

    def rows(n):
        out = []
        for _ in range(n):
            w = draw(st.lists(weight, min_size=vocab, max_size=vocab))
            if sum(w) == 0:
                w[draw(st.integers(0, vocab - 1))] = 1.0
            out.append(w)
        t = torch.tensor(out, dtype=torch.float32).reshape(n, vocab)
        return t / t.sum(-1, keepdim=True)

    return rows(k + 1), rows(k), draw(st.integers(0, 2**31 - 1))


@given(target_and_draft())
def test_emitted_tokens_follow_target_distribution(chapter, case):
    sd = chapter("spec_decode")
    p, q, seed = case
    out = simulate_identical_requests(p, q, N, sd.rejection_sample, torch.Generator().manual_seed(seed))
    assert passes_lossless_test(out, p, ALPHA), (
        f"emitted tokens do not follow the target distribution (lossy sampler); p-values per position: "
        f"{position_pvalues(out, p)}")


@given(target_and_draft())
def test_ngram_rule_is_lossless_for_a_fixed_draft(chapter, case):
    """Without draft probabilities, accept with p(x) and recover from p with x zeroed: lossless for any fixed x."""
    sd = chapter("spec_decode")
    p, q, seed = case
    out = simulate_identical_requests(p, q, N, sd.rejection_sample, torch.Generator().manual_seed(seed), "no_probs")
    assert passes_lossless_test(out, p, ALPHA), f"n-gram rule is lossy; p-values: {position_pvalues(out, p)}"


@settings(max_examples=3)
@given(target_and_draft(max_vocab=8, max_k=2))
def test_per_request_reference_is_lossless(chapter, case):
    """Same test on the per-request function itself (fewer samples: it is a Python loop)."""
    sd = chapter("spec_decode")
    p, q, seed = case
    out = simulate_identical_requests(p, q, 3000, sd.rejection_sample_reference, torch.Generator().manual_seed(seed))
    assert passes_lossless_test(out, p, ALPHA), f"per-request sampler is lossy; p-values: {position_pvalues(out, p)}"


def _fixed_cases(n_cases=5, vocab=8, k=3):
    g = torch.Generator().manual_seed(2024)
    dirichlet = lambda rows: torch.distributions.Dirichlet(torch.ones(vocab)).sample((rows,))  # noqa: E731
    torch.manual_seed(2024)
    return [(dirichlet(k + 1), dirichlet(k), g) for _ in range(n_cases)]


@pytest.mark.parametrize("lossy_sampler", [lossy.accept_always, lossy.recover_from_target], ids=lambda f: f.__name__)
def test_lossy_controls_fail_the_same_test(lossy_sampler):
    """Power check: the same test at the same ALPHA and N must reject known-lossy samplers."""
    for p, q, g in _fixed_cases():
        out = simulate_identical_requests(p, q, N, lossy_sampler, g)
        assert not passes_lossless_test(out, p, ALPHA), (
            f"{lossy_sampler.__name__} passed the lossless test: the test has no power; p-values "
            f"{position_pvalues(out, p)}")
