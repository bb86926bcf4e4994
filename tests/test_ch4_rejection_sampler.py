"""Chapter 4: rejection-sampler rules, batched == per-request reference, seeding, bad input."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mini_vllm.spec_decode.random_draws import random_verify_batch
from strategies import verify_batch_specs

PH = -1


def make_batch(spec):
    g = torch.Generator().manual_seed(spec.seed)
    return random_verify_batch(spec.num_draft_tokens, spec.vocab_size, spec.is_greedy, spec.with_draft_probs, g)


@given(verify_batch_specs())
def test_batched_equals_per_request_reference_on_identical_draws(chapter, spec):
    sd = chapter("spec_decode")
    args = make_batch(spec)
    ref = sd.rejection_sample_reference(*args)
    out = sd.rejection_sample(*args)
    assert torch.equal(out, ref), f"batched and per-request samplers disagree on the same draws:\n{out}\n{ref}"


@given(verify_batch_specs())
def test_output_structure(chapter, spec):
    sd = chapter("spec_decode")
    args = make_batch(spec)
    out = sd.rejection_sample_reference(*args)
    num = args[1]
    assert out.shape == (len(num), int(num.max()) + 1), "output must be [batch, max_k + 1]"
    for b, k in enumerate(num.tolist()):
        row = out[b].tolist()
        n_emit = sum(t != PH for t in row)
        assert 1 <= n_emit <= k + 1, f"request {b} emitted {n_emit} tokens; a verify step emits 1..k+1"
        assert all(t != PH for t in row[:n_emit]) and all(t == PH for t in row[n_emit:]), (
            f"placeholders must only follow the emitted prefix: {row}")
        assert all(0 <= t < spec.vocab_size for t in row[:n_emit]), f"token outside the vocabulary: {row}"
        start = int(num[:b].sum())
        drafts = args[0][start:start + k].tolist()
        assert row[: n_emit - 1] == drafts[: n_emit - 1], "every token before the last must be an accepted draft"
        if n_emit == k + 1:
            assert row[k] == int(args[4][b]), "all drafts accepted: the last token must be the bonus token"


@given(st.integers(1, 12), st.integers(0, 4), st.integers(0, 2**31 - 1))
def test_greedy_rule(chapter, vocab, k, seed):
    """Greedy: accept while the draft equals the target argmax; emit the argmax at the first mismatch."""
    sd = chapter("spec_decode")
    g = torch.Generator().manual_seed(seed)
    drafts, num, dprobs, target, bonus, greedy, u, noise = random_verify_batch([k], vocab, [True], True, g)
    argmax = target.argmax(-1)
    # Make a random prefix of drafts match the argmax so that acceptance runs are exercised.
    n_match = int(torch.randint(0, k + 1, (1,), generator=g))
    drafts = drafts.clone()
    drafts[:n_match] = argmax[:n_match]
    row = sd.rejection_sample_reference(drafts, num, dprobs, target, bonus, greedy, u, noise)[0].tolist()
    expected = []
    for i in range(k):
        expected.append(int(argmax[i]))
        if int(drafts[i]) != int(argmax[i]):
            break
    else:
        expected.append(int(bonus[0]))
    assert row[: len(expected)] == expected, f"greedy verification wrong: got {row}, want {expected}"


def test_empty_drafts_give_bonus_only(chapter):
    sd = chapter("spec_decode")
    g = torch.Generator().manual_seed(0)
    args = random_verify_batch([0, 0, 0], 7, [True, False, False], True, g)
    for fn in (sd.rejection_sample_reference, sd.rejection_sample):
        out = fn(*args)
        assert out.shape == (3, 1) and torch.equal(out[:, 0], args[4]), "k = 0 must emit exactly the bonus token"


def test_all_accepted_gives_k_plus_one_tokens(chapter):
    """q == p makes u * q(x) < p(x) hold for every u < 1: every draft is accepted."""
    sd = chapter("spec_decode")
    g = torch.Generator().manual_seed(1)
    drafts, num, _, target, bonus, greedy, u, noise = random_verify_batch([4, 2], 9, [False, False], True, g)
    drafts = torch.multinomial(target, 1, generator=g).squeeze(1)
    for fn in (sd.rejection_sample_reference, sd.rejection_sample):
        out = fn(drafts, num, target.clone(), target, bonus, greedy, u, noise)
        assert out[0].tolist() == drafts[:4].tolist() + [int(bonus[0])], "all accepted: 4 drafts + bonus"
        assert out[1].tolist() == drafts[4:].tolist() + [int(bonus[1]), PH, PH], "k=2, all accepted, then padding"


def test_zero_target_probability_is_never_accepted(chapter):
    """p(x) = 0 must reject even with u = 0 (strict comparison), and recovery must avoid x."""
    sd = chapter("spec_decode")
    target = torch.tensor([[0.0, 0.5, 0.5]])
    draft = torch.tensor([[1.0, 0.0, 0.0]])
    args = (torch.tensor([0]), torch.tensor([1]), draft, target, torch.tensor([2]), torch.tensor([False]),
            torch.zeros(1), torch.ones(1, 3))
    for fn in (sd.rejection_sample_reference, sd.rejection_sample):
        row = fn(*args)[0].tolist()
        assert row[0] in (1, 2) and row[1] == PH, f"a token the target gives zero mass was emitted or accepted: {row}"


def test_mixed_greedy_and_random_batch(chapter):
    """A greedy request's result must not change when random neighbours join it (and vice versa)."""
    sd = chapter("spec_decode")
    g = torch.Generator().manual_seed(3)
    full = random_verify_batch([3, 2, 4], 11, [True, False, True], True, g)
    out = sd.rejection_sample(*full)
    for b, (lo, hi) in enumerate([(0, 3), (3, 5), (5, 9)]):
        alone = (full[0][lo:hi], full[1][b:b + 1], full[2][lo:hi], full[3][lo:hi], full[4][b:b + 1],
                 full[5][b:b + 1], full[6][lo:hi], full[7][b:b + 1])
        solo = sd.rejection_sample_reference(*alone)[0]
        assert out[b, : solo.shape[0]].tolist() == solo.tolist(), f"request {b} changed when batched with others"


def test_seeded_request_is_deterministic_whatever_its_neighbours(chapter):
    sd = chapter("spec_decode")
    vocab = 13
    logits_g = torch.Generator().manual_seed(5)
    my_logits = torch.randn(4, vocab, generator=logits_g)  # 3 draft rows + bonus
    my_draft_logits = torch.randn(3, vocab, generator=logits_g)
    my_drafts = [1, 5, 7]

    def run(neighbours: int, neighbour_k: int, seed_neighbours: bool):
        drafts = [my_drafts] + [[(i + j) % vocab for j in range(neighbour_k)] for i in range(neighbours)]
        meta = sd.SpecDecodeMetadata.make(drafts)
        rows, drows = [my_logits], [my_draft_logits]
        for _ in range(neighbours):
            rows.append(torch.randn(neighbour_k + 1, vocab))
            drows.append(torch.randn(neighbour_k, vocab))
        sampling = sd.TemperatureTopKTopP.make([0.8] + [1.0] * neighbours, [5] + [0] * neighbours,
                                               [0.9] + [1.0] * neighbours)
        gens = {0: torch.Generator().manual_seed(1234)}
        if seed_neighbours:
            gens.update({i: torch.Generator().manual_seed(i) for i in range(1, neighbours + 1)})
        out = sd.RejectionSampler("torch")(meta, None, torch.cat(rows), sampling, gens, draft_logits=torch.cat(drows))
        return out[0, :4].tolist()

    results = {tuple(run(n, kk, s)) for n, kk, s in [(0, 0, False), (3, 2, False), (5, 4, True), (3, 2, False)]}
    torch.manual_seed(99)  # different global RNG state for the unseeded neighbours
    results.add(tuple(run(2, 1, False)))
    assert len(results) == 1, f"a seeded request's output depended on its batch neighbours: {results}"


@settings(max_examples=10)
@given(st.integers(2, 16), st.integers(1, 4), st.integers(0, 16), st.floats(0.05, 1.0), st.integers(0, 2**31 - 1))
def test_emitted_tokens_stay_inside_top_k_top_p_set(chapter, vocab, k, top_k, top_p, seed):
    sd = chapter("spec_decode")
    g = torch.Generator().manual_seed(seed)
    batch = 8
    logits = torch.randn(batch * (k + 1), vocab, generator=g) * 3
    draft_logits = torch.randn(batch * k, vocab, generator=g) * 3
    drafts = torch.randint(0, vocab, (batch, k), generator=g).tolist()
    meta = sd.SpecDecodeMetadata.make(drafts)
    sampling = sd.TemperatureTopKTopP.make([1.3] * batch, [top_k] * batch, [top_p] * batch)
    gens = {i: torch.Generator().manual_seed(seed + i) for i in range(batch)}
    for backend in ("reference", "torch"):
        out = sd.RejectionSampler(backend)(meta, None, logits, sampling, gens, draft_logits=draft_logits)
        kept = sd.logits_to_probs(logits, sampling, torch.full((batch,), k + 1)) > 0
        for b in range(batch):
            for i, t in enumerate(out[b].tolist()):
                if t != PH:
                    assert 0 <= t < vocab and kept[b * (k + 1) + i, t], (
                        f"{backend}: token {t} at position {i} lies outside the target's top-k/top-p set")


def _good_args():
    return random_verify_batch([2, 1], 5, [False, True], True, torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "index, bad, match",
    [
        (0, torch.tensor([0, 1, 7]), r"draft_token_ids must lie in \[0, 5\)"),
        (0, torch.tensor([0, 1]), "num_draft_tokens sums to 3"),
        (1, torch.tensor([-1, 4]), "num_draft_tokens must be >= 0"),
        (2, torch.full((3, 5), 0.5), "draft_probs must sum to 1"),
        (2, torch.full((3, 4), 0.25), "draft_probs must have shape"),
        (3, torch.full((3, 5), -0.2), "target_probs must be non-negative"),
        (3, torch.full((3, 5), float("nan")), "target_probs must be finite"),
        (4, torch.tensor([0, 5]), r"bonus_token_ids must lie in \[0, 5\)"),
        (5, torch.tensor([True]), "is_greedy must have shape"),
        (6, torch.tensor([0.1, 0.2, 1.0]), r"uniform_probs must lie in \[0, 1\)"),
        (7, torch.zeros(2, 5), "recovery_noise must be strictly positive"),
    ],
)
def test_bad_input_raises_clear_error(chapter, index, bad, match):
    sd = chapter("spec_decode")
    args = list(_good_args())
    args[index] = bad
    if index == 2 and "sum" in match:
        args[2] = bad
    for fn in (sd.rejection_sample_reference, sd.rejection_sample):
        with pytest.raises(ValueError, match=match.replace("draft_probs must sum", "each row of draft_probs must sum")):
            fn(*args)


def test_bad_sampling_parameters_raise(chapter):
    sd = chapter("spec_decode")
    for kwargs, match in [(dict(temperature=[-1.0]), "temperature"), (dict(temperature=[1.0], top_k=[-2]), "top_k"),
                          (dict(temperature=[1.0], top_p=[0.0]), "top_p")]:
        with pytest.raises(ValueError, match=match):
            sd.TemperatureTopKTopP.make(**kwargs)


def test_rejection_sampler_rejects_bad_logits_shape(chapter):
    sd = chapter("spec_decode")
    meta = sd.SpecDecodeMetadata.make([[1, 2], [3]])
    sampling = sd.TemperatureTopKTopP.make([1.0, 1.0])
    with pytest.raises(ValueError, match=r"target_logits must be \[sum\(num_draft_tokens \+ 1\) = 5"):
        sd.RejectionSampler()(meta, None, torch.randn(4, 6), sampling)
    with pytest.raises(ValueError, match="sampling metadata has 1 requests but the batch has 2"):
        sd.RejectionSampler()(meta, None, torch.randn(5, 6), sd.TemperatureTopKTopP.make([1.0]))
    with pytest.raises(ValueError, match="backend"):
        sd.RejectionSampler("cuda")


def test_all_zero_residual_recovers_from_target(chapter):
    """q >= p everywhere (p and q equal up to rounding) makes max(0, p - q) all
    zero; a rejection then has no residual to sample, and both samplers must
    fall back to p instead of emitting an arbitrary token (index 0)."""
    sd = chapter("spec_decode")
    target = torch.tensor([[0.5, 0.25, 0.25]])
    draft = torch.tensor([[0.5002, 0.25, 0.25]])  # sums to 1.0002: within the validator's tolerance
    noise = torch.tensor([[1.0, 0.01, 1.0]])       # p / noise peaks at token 1; residual / noise is all 0
    args = (torch.tensor([0]), torch.tensor([1]), draft, target, torch.tensor([2]), torch.tensor([False]),
            torch.tensor([0.99999]), noise)         # u * q(0) > p(0): rejected
    for fn in (sd.rejection_sample_reference, sd.rejection_sample):
        row = fn(*args)[0].tolist()
        name = getattr(fn, "__name__", repr(fn))  # the exercise may hand in a partial or other callable
        assert row == [1, PH], f"{name}: an all-zero residual must recover from p, got {row}"
