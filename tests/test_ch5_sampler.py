"""Chapter 5: the engine's sampler, end to end (filters alone: test_ch5_sampler_filters.py).

(b) chi-square tests of whole-sampler output against distributions filtered
by hand, with lossy controls the same test must reject; (c) seeded rows;
(d) penalties; (e) min_tokens; (f) logprobs; (g) greedy rows.
"""
import math

import pytest
import torch
from oracles import filtered_distribution
from scipy.stats import chisquare

from mini_vllm.sample.sampler import Sampler, apply_penalties
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sampling_params import SamplingParams

NEG = float("-inf")


def build(params, vocab, prompts=None, outputs=None, generators=None, eos=None):
    b = len(params)
    return SamplingMetadata.from_params(
        params, prompts or [[0]] * b, outputs or [[] for _ in range(b)], generators or [None] * b,
        eos or [None] * b, vocab)


# ------------------------------------------------------------- (b) statistics
LOGITS8 = [2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -1.0]
N_SAMPLES = 20_000
CONFIGS = {  # name: (params for the sampler, lossy control: (params, logits transform))
    "temperature": (dict(temperature=0.7), (dict(temperature=0.7), lambda z: [x / 0.7 for x in z])),
    "top_k": (dict(top_k=3), (dict(top_k=2), None)),
    "top_p": (dict(top_p=0.6), (dict(top_p=0.45), None)),  # 0.45 drops the boundary token
    "min_p": (dict(min_p=0.2), (dict(min_p=0.4), None)),  # 0.4 drops the 4th token
    "combined": (dict(temperature=0.8, top_k=5, top_p=0.8, min_p=0.1),
                 (dict(temperature=0.8, top_k=5, top_p=0.8, min_p=0.1), lambda z: [x / 0.8 for x in z])),
}
ALPHA = 1e-3 / len(CONFIGS)  # Bonferroni: family-wise 1e-3 over the configurations


def sample_counts(logits, params):
    torch.manual_seed(1234)
    md = build([SamplingParams(**params)] * N_SAMPLES, len(logits))
    tokens = Sampler()(torch.tensor([logits] * N_SAMPLES), md).sampled_token_ids
    return torch.bincount(tokens, minlength=len(logits)).tolist()


def chi_square_p(counts, expected_probs):
    if any(c > 0 and q == 0 for c, q in zip(counts, expected_probs)):
        return 0.0  # a token outside the support: impossible under the expected distribution
    obs = [c for c, q in zip(counts, expected_probs) if q > 0]
    exp = [q * N_SAMPLES for q in expected_probs if q > 0]
    if len(obs) == 1:
        return 1.0 if obs[0] == N_SAMPLES else 0.0
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sampler_distribution_chi_square(name):
    params, (lossy_params, lossy_logits) = CONFIGS[name]
    expected = filtered_distribution(LOGITS8, **params)
    p_ok = chi_square_p(sample_counts(LOGITS8, params), expected)
    assert p_ok > ALPHA, f"{name}: sampled tokens do not follow the hand-filtered distribution (p={p_ok:.2e})"
    # Power: a lossy variant (temperature applied twice, or a filter one step too tight) must be rejected.
    bad_logits = lossy_logits(LOGITS8) if lossy_logits else LOGITS8
    p_bad = chi_square_p(sample_counts(bad_logits, lossy_params), expected)
    assert p_bad < ALPHA, f"{name}: the chi-square test cannot tell a lossy sampler apart (p={p_bad:.2e})"


# ---------------------------------------------------------- (c) seeded rows
def run_steps(batch_params, seeded_rows, steps, vocab=50):
    """Tokens per step; generators made once per seeded row and kept across steps, like a request's."""
    gens = [torch.Generator().manual_seed(p.seed) if i in seeded_rows else None for i, p in enumerate(batch_params)]
    g_logits = torch.Generator().manual_seed(99)
    out = []
    for _ in range(steps):
        step_logits = 2.0 * torch.randn(1, vocab, generator=g_logits)  # same logits for every row
        md = build(batch_params, vocab, generators=gens)
        torch.rand(13)  # unrelated global-RNG use between steps must not matter
        out.append(Sampler()(step_logits.expand(len(batch_params), vocab).contiguous(), md).sampled_token_ids.tolist())
    return out


def test_seeded_rows_reproducible_and_batch_invariant():
    target = SamplingParams(temperature=0.9, top_k=20, seed=1234)
    alone = [s[0] for s in run_steps([target], {0}, 8)]
    torch.manual_seed(7)
    again = [s[0] for s in run_steps([target], {0}, 8)]
    assert alone == again, "a seeded request must give the same tokens on every run"
    neighbours = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.5, top_p=0.7, seed=5), target, SamplingParams(min_p=0.1)]
    in_batch = [s[3] for s in run_steps(neighbours, {2, 3}, 8)]
    assert in_batch == alone, (
        "a seeded row must draw only from its own generator: batch neighbours (random, greedy, seeded, "
        "top-p forcing the sort path) changed its tokens")
    other_seed = [s[0] for s in run_steps([SamplingParams(temperature=0.9, top_k=20, seed=4321)], {0}, 8)]
    assert other_seed != alone, "a different seed must give different draws"


# ---------------------------------------------------------- (d) penalties
PEN_RAW = [1.5, -0.5, 2.0, 0.8, -1.0, 0.2]
PEN_PROMPT, PEN_OUTPUT = [1, 2], [2, 3, 3]  # token 1: prompt only; 2: both; 3: output, twice; 0, 4, 5: unseen


def _penalised(**penalty) -> list[float]:
    md = build([SamplingParams(temperature=0.0, **penalty)], 6, prompts=[PEN_PROMPT], outputs=[PEN_OUTPUT])
    return apply_penalties(torch.tensor([PEN_RAW]), md)[0].tolist()


def _close(a, b):
    return abs(a - b) < 1e-6


def test_repetition_penalty_counts_prompt_and_output_tokens_once_sign_aware():
    r = 2.0
    got = _penalised(repetition_penalty=r)
    for t in (0, 4, 5):
        assert _close(got[t], PEN_RAW[t]), f"repetition penalty changed token {t}, which is in neither prompt nor output"
    assert not _close(got[1], PEN_RAW[1]), \
        "repetition penalty ignored the prompt tokens (token 1 occurs in the prompt only; vLLM counts prompt + output)"
    assert not _close(got[3], PEN_RAW[3]), "repetition penalty ignored the output tokens (token 3 occurs in the output)"
    assert _close(got[1], PEN_RAW[1] * r), (f"repetition penalty on a negative logit gave {got[1]}, want "
                                            f"{PEN_RAW[1] * r}: it must multiply by r (push down), not divide")
    assert _close(got[2], PEN_RAW[2] / r), f"repetition penalty on a positive logit gave {got[2]}, want {PEN_RAW[2] / r}"
    assert _close(got[3], PEN_RAW[3] / r), (f"repetition penalty on token 3 (output twice) gave {got[3]}, want "
                                            f"{PEN_RAW[3] / r}: it applies once per seen token, not per occurrence")


def test_frequency_penalty_counts_output_occurrences_only():
    f = 0.5
    got = _penalised(frequency_penalty=f)
    assert _close(got[1], PEN_RAW[1]), ("frequency penalty counted prompt tokens (token 1 occurs in the prompt only); "
                                        "it counts output tokens only")
    assert _close(got[2], PEN_RAW[2] - f), (f"frequency penalty on token 2 (prompt once, output once) gave {got[2]}, "
                                            f"want {PEN_RAW[2] - f}: prompt occurrences must not count")
    assert _close(got[3], PEN_RAW[3] - 2 * f), (
        f"frequency penalty on token 3 (output twice) gave {got[3]}, want {PEN_RAW[3] - 2 * f}"
        + (": it counted presence (0/1) instead of occurrences" if _close(got[3], PEN_RAW[3] - f) else ""))
    for t in (0, 4, 5):
        assert _close(got[t], PEN_RAW[t]), f"frequency penalty changed token {t}, which is not in the output"


def test_presence_penalty_is_once_per_output_token():
    p = 0.25
    got = _penalised(presence_penalty=p)
    assert _close(got[1], PEN_RAW[1]), ("presence penalty counted prompt tokens (token 1 occurs in the prompt only); "
                                        "it looks at output tokens only")
    assert _close(got[2], PEN_RAW[2] - p), f"presence penalty on token 2 (in the output) gave {got[2]}, want {PEN_RAW[2] - p}"
    assert _close(got[3], PEN_RAW[3] - p), (
        f"presence penalty on token 3 (output twice) gave {got[3]}, want {PEN_RAW[3] - p}"
        + (": it counted occurrences (a frequency penalty), not presence" if _close(got[3], PEN_RAW[3] - 2 * p) else ""))
    for t in (0, 4, 5):
        assert _close(got[t], PEN_RAW[t]), f"presence penalty changed token {t}, which is not in the output"


def test_penalties_combined_and_rows_without_penalties():
    rep, freq, pres = 2.0, 0.5, 0.25
    want = []
    for t, x in enumerate(PEN_RAW):
        if t in PEN_PROMPT or t in PEN_OUTPUT:  # repetition first, then frequency and presence
            x = x / rep if x > 0 else x * rep
        want.append(x - freq * PEN_OUTPUT.count(t) - pres * (t in PEN_OUTPUT))
    params = [SamplingParams(temperature=0.0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres),
              SamplingParams(temperature=0.0)]
    md = build(params, 6, prompts=[PEN_PROMPT, [0, 1, 2, 3]], outputs=[PEN_OUTPUT, [2, 2]])
    logits = torch.tensor([PEN_RAW, PEN_RAW])
    got = apply_penalties(logits, md)
    assert torch.allclose(got[0], torch.tensor(want), atol=1e-6), (
        f"all three penalties together gave {got[0].tolist()}, want {want} (repetition divides or multiplies "
        "before frequency and presence subtract)")
    assert torch.equal(got[1], logits[1]), "a row without penalties must be left untouched by its neighbour's"
    # Raw argmax is token 2; after penalties token 0 wins: the sampler must argmax the penalised logits.
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [0, 2], "greedy must see the penalised logits"


# ---------------------------------------------------------- (e) min_tokens
def test_min_tokens_masks_eos_and_stop_ids():
    vocab, eos, stop = 6, 0, 4
    raw = torch.tensor([[9.0, 1.0, 2.0, 0.5, 8.0, 0.0]])  # EOS, then the stop id, are the likely tokens
    for n_out, allowed_stop in ((0, False), (1, False), (2, False), (3, True)):
        params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop]),
                  SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[stop], seed=n_out)]
        md = build(params * 100, vocab, outputs=[[5] * n_out] * 200, eos=[eos] * 200,
                   generators=[None, torch.Generator().manual_seed(n_out)] * 100)
        tokens = Sampler()(raw.expand(200, vocab), md).sampled_token_ids
        hit_stop = bool(((tokens == eos) | (tokens == stop)).any())
        if allowed_stop:
            assert tokens[0] == eos, "once min_tokens is reached, EOS must be sampleable again"
        else:
            assert not hit_stop, f"with {n_out} < min_tokens=3 outputs, EOS and stop ids must be masked"
            assert tokens[0] == 2, "greedy must pick the best token that is not a stop id"
    md = build([SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)], vocab, eos=[eos])
    assert Sampler()(raw, md).sampled_token_ids.tolist() == [eos], "ignore_eos: EOS does not stop, so min_tokens leaves it"
    before = raw.clone()
    Sampler()(raw, build([SamplingParams(temperature=0.0, min_tokens=3)], vocab, eos=[eos]))
    assert torch.equal(raw, before), "the sampler must not edit the caller's logits"


# ---------------------------------------------------------- (f) logprobs
def test_logprobs_of_processed_distribution():
    raw = [1.0, 3.0, 2.5, -1.0, 2.9, 0.0]
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=2, seed=3),
              SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(temperature=2.0, min_p=0.5)]
    md = build(params, 6, generators=[torch.Generator().manual_seed(3), None, None])
    assert md.max_num_logprobs == 2, (
        f"max_num_logprobs must be the largest logprobs asked in the batch (2), got {md.max_num_logprobs}")
    out = Sampler("processed_logprobs")(torch.tensor([raw] * 3), md)
    lp = out.logprobs_tensors
    assert lp.logprobs.shape == (3, 3) and lp.logprob_token_ids.shape == (3, 3), (
        "logprobs must hold the sampled token plus the batch's top max_num_logprobs=2 per row: "
        f"{tuple(lp.logprobs.shape)} {tuple(lp.logprob_token_ids.shape)}")
    for row, (temp, k, m) in enumerate([(0.5, 3, 0.0), (1.0, 0, 0.0), (2.0, 0, 0.5)]):
        q = filtered_distribution(raw, temperature=temp, top_k=k, min_p=m)
        hand = [math.log(x) if x > 0 else NEG for x in q]
        tok = int(out.sampled_token_ids[row])
        assert q[tok] > 0, "sampled a filtered-out token"
        order = sorted(range(6), key=lambda t: -hand[t])
        assert lp.logprob_token_ids[row].tolist() == [tok] + order[:2], "column 0 = sampled, then the top-N ids"
        want = torch.tensor([hand[tok]] + [hand[t] for t in order[:2]])
        assert torch.allclose(lp.logprobs[row], want, atol=1e-5), (
            f"row {row}: logprobs must be of the processed distribution (temperature, filters), got "
            f"{lp.logprobs[row].tolist()} want {want.tolist()}")
        assert int(lp.selected_token_ranks[row]) == 1 + sum(h > hand[tok] for h in hand), "rank of the sampled token"
    assert out.logprobs_tensors is not None and build(params[2:], 6).max_num_logprobs is None, (
        "logprobs not computed though asked, or a batch that asks none still gets a max_num_logprobs")


def test_logprobs_default_to_the_raw_model_distribution():
    """vLLM's default logprobs_mode, "raw_logprobs": temperature, top-k and penalties change
    what is sampled but not the reported logprobs, which are the model's own."""
    raw = [1.0, 3.0, 2.5, -1.0, 2.9, 0.0]
    params = [SamplingParams(temperature=0.5, top_k=1, logprobs=3, seed=3),
              SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0)]
    md = build(params, 6, generators=[torch.Generator().manual_seed(3), None], outputs=[[], [1]])
    out = Sampler()(torch.tensor([raw] * 2), md)
    want = torch.tensor(raw).log_softmax(-1)
    top3 = want.topk(3).indices.tolist()
    assert out.sampled_token_ids.tolist() == [1, 4], "top_k=1 keeps the argmax; the penalty moves greedy off token 1"
    for row in range(2):
        tok = int(out.sampled_token_ids[row])
        got = out.logprobs_tensors
        assert got.logprob_token_ids[row].tolist() == [tok] + top3, "raw mode: top-N of the raw distribution"
        assert torch.allclose(got.logprobs[row], want[[tok] + top3], atol=1e-6), (
            f"row {row}: logprobs must be the raw model distribution (vLLM's default raw_logprobs), "
            f"not the processed one: got {got.logprobs[row].tolist()}")
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler("processed")


def test_rank_counts_ties():
    md = build([SamplingParams(temperature=0.0, logprobs=0)], 3)
    out = Sampler()(torch.tensor([[1.0, 4.0, 4.0]]), md)
    assert out.sampled_token_ids.tolist() == [1], (
        f"greedy must pick the first of tied maxima (argmax's tie rule), got {out.sampled_token_ids.tolist()}")
    assert out.logprobs_tensors.selected_token_ranks.tolist() == [2], "rank = tokens at least as likely (vLLM)"
    assert out.logprobs_tensors.logprobs.shape == (1, 1), "logprobs=0 returns only the sampled token"


# ---------------------------------------------------------- (g) greedy rows
def test_greedy_rows_are_argmax_in_mixed_batches():
    g = torch.Generator().manual_seed(11)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_p=0.5),
             SamplingParams(temperature=0.0, top_k=2), SamplingParams(temperature=0.7, min_p=0.2, top_k=4),
             SamplingParams(temperature=1e-6), SamplingParams(temperature=1.0)]
    for _ in range(10):
        logits = 3.0 * torch.randn(len(kinds), 300, generator=g)
        out = Sampler()(logits, build(kinds, 300)).sampled_token_ids
        for row in (0, 2, 4):
            assert int(out[row]) == int(logits[row].argmax()), "greedy rows must be the raw argmax whatever the batch"
    md = build([SamplingParams(temperature=0.0)] * 4, 300)
    logits = torch.randn(4, 300, generator=g)
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1)), "all-greedy fast path"


def test_empty_batch():
    md = build([], 7)
    out = Sampler()(torch.zeros(0, 7), md)
    assert out.sampled_token_ids.shape == (0,) and out.logprobs_tensors is None, "an empty batch samples nothing"
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 7), md)


def test_greedy_argmax_is_argmax_on_ties():
    """The greedy pick (`max(dim).indices`, faster than argmax on the CPU) must be argmax's
    pick: the first of tied maxima, in fp32 and bf16, NaN rows included."""
    from mini_vllm.sample.sampler import greedy_argmax

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randint(0, 3, (64, 6144), generator=g).to(dtype)  # every row full of ties
        x[5, 100] = float("nan")
        got, want = greedy_argmax(x), x.argmax(dim=-1)
        assert torch.equal(got, want), (f"{dtype}: greedy_argmax picked {got[got != want][:4].tolist()} where argmax "
                                        f"picks {want[got != want][:4].tolist()}: not the first of tied maxima")
