"""Chapter 4: n-gram and draft-model proposers, verify-step bookkeeping, and
greedy speculative decoding == plain greedy decoding of the target."""
import pytest
import torch
from hypothesis import given, strategies as st

from strategies import token_id_lists

VOCAB = 11


def brute_force_ngram(tokens, min_n, max_n, k, occurrence="earliest"):
    """Oracle: scan every earlier start (oldest or newest first), for n = max_n..min_n."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        starts = range(length - n) if occurrence == "earliest" else range(length - n - 1, -1, -1)
        for i in starts:
            if tokens[i:i + n] == tokens[length - n:]:
                return tokens[i + n:i + n + k]
    return []


@given(token_id_lists(vocab_size=4, max_size=40), st.integers(1, 3), st.integers(0, 3), st.integers(0, 5))
def test_ngram_matches_brute_force(chapter, tokens, min_n, extra, k):
    sd = chapter("spec_decode")
    max_n = min_n + extra
    got = sd.propose_ngram(tokens, min_n, max_n, k)
    assert list(got) == brute_force_ngram(tokens, min_n, max_n, k), (
        f"n-gram proposal differs from the brute-force oracle for {tokens} (n {min_n}..{max_n}, k {k})")


def test_ngram_prefers_longest_then_earliest(chapter):
    sd = chapter("spec_decode")
    tokens = [1, 2, 3, 9, 2, 3, 7, 5, 2, 3]
    # n=3 "5 2 3": no earlier match; n=2 "2 3": earliest at index 1 -> follows 9, 2, 3
    assert sd.propose_ngram(tokens, 1, 3, 3) == [9, 2, 3], \
        "must take the earliest match, as vLLM does (the most recent one follows 7, 5, 2)"
    assert sd.propose_ngram(tokens, 1, 3, 3, occurrence="latest") == [7, 5, 2], \
        "occurrence='latest' must take the most recent earlier match"
    tokens = [8, 2, 3, 4, 1, 3, 6, 8, 2, 3]
    assert sd.propose_ngram(tokens, 1, 3, 2) == [4, 1], "a longer n-gram match must win over a shorter one"
    assert sd.NgramProposer(1, 3, 2).propose([tokens, [5]]) == [[4, 1], []], "no match gives an empty draft"


@pytest.mark.parametrize("period", [1, 3])
def test_ngram_on_periodic_text(chapter, period):
    """On periodic text the latest match is one period back, so its continuation
    hits the end of the context: it proposes at most `period` tokens. The
    earliest match proposes all k."""
    sd = chapter("spec_decode")
    motif = [7, 4, 9][:period]
    tokens = motif * (50 // period)
    want = (tokens * 2)[len(tokens):len(tokens) + 4]  # the text continues periodically
    assert sd.propose_ngram(tokens, 1, 3, 4) == want, "earliest match must propose k = 4 periodic tokens"
    latest = sd.propose_ngram(tokens, 1, 3, 4, occurrence="latest")
    assert latest == want[:period], f"latest match proposes only one period, got {latest}"


@given(token_id_lists(vocab_size=3, max_size=30), st.integers(1, 4))
def test_ngram_latest_matches_brute_force(chapter, tokens, k):
    sd = chapter("spec_decode")
    assert list(sd.propose_ngram(tokens, 1, 3, k, occurrence="latest")) == \
        brute_force_ngram(tokens, 1, 3, k, occurrence="latest"), (
            f"latest-occurrence n-gram proposal differs from brute force on {tokens} k={k} (longest n tried "
            "first? the most recent match taken?)")


def test_ngram_bad_arguments(chapter):
    sd = chapter("spec_decode")
    with pytest.raises(ValueError, match="min_n"):
        sd.propose_ngram([1, 2], 0, 2, 1)
    with pytest.raises(ValueError, match="min_n"):
        sd.NgramProposer(3, 2, 1)
    with pytest.raises(ValueError, match="k"):
        sd.NgramProposer(1, 2, 0)


def _markov_model(seed, scale=3.0):
    """Deterministic toy LM: logits depend on the last two tokens (a fixed random table)."""
    table = torch.randn(VOCAB, VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale

    def model(contexts):
        return torch.stack([table[c[-2] if len(c) > 1 else 0, c[-1]] for c in contexts])

    return model


def _spec_decode_greedy(sd, target, propose, prompt, n_new, backend):
    ctx = list(prompt)
    num_computed, num_tokens = len(prompt) - 1, len(prompt)  # the last prompt token is pending
    steps = 0
    while len(ctx) < len(prompt) + n_new:
        drafts, draft_probs = propose(ctx)
        logits = target([ctx + drafts[:i] for i in range(len(drafts) + 1)])
        meta = sd.SpecDecodeMetadata.make([drafts])
        out = sd.RejectionSampler(backend)(meta, draft_probs, logits, sd.TemperatureTopKTopP.make([0.0]))[0]
        accepted = sd.num_accepted_from_output(out, len(drafts))
        num_computed, num_tokens = sd.apply_verify_step(num_computed, num_tokens, len(drafts), accepted)
        ctx += out[out != -1].tolist()
        steps += 1
        assert num_tokens == len(ctx) and num_computed == len(ctx) - 1, (
            "Table 4.1 bookkeeping drifted from the real sequence length")
    return ctx[: len(prompt) + n_new], steps


def _greedy(target, prompt, n_new):
    ctx = list(prompt)
    for _ in range(n_new):
        ctx.append(int(target([ctx])[0].argmax()))
    return ctx


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_greedy_speculative_decoding_equals_target_greedy(chapter, backend, proposer):
    sd = chapter("spec_decode")
    target = _markov_model(0)
    if proposer == "ngram":
        ng = sd.NgramProposer(1, 3, 4)
        propose = lambda ctx: (ng.propose([ctx])[0], None)  # noqa: E731
    else:
        # A draft that agrees with the target most of the time: target table plus noise.
        noisy = _markov_model(0)
        noise = _markov_model(1, scale=1.5)
        draft = sd.NextTokenModelProposer(lambda c: noisy(c) + noise(c), k=3)

        def propose(ctx):
            toks, probs = draft.propose([ctx], sd.TemperatureTopKTopP.make([0.0]))
            return toks[0].tolist(), probs[0]
    for prompt in ([1, 2, 3], [4, 4, 4, 4, 5], [7]):
        want = _greedy(target, prompt, 30)
        got, steps = _spec_decode_greedy(sd, target, propose, prompt, 30, backend)
        assert got == want, f"{proposer}/{backend}: greedy speculative decoding changed the output"
    if proposer == "draft_model":
        assert steps < 30, "a mostly-agreeing draft should need fewer verify steps than tokens"


def test_draft_model_proposer_probs_and_seeding(chapter):
    sd = chapter("spec_decode")
    model = _markov_model(3)
    prop = sd.NextTokenModelProposer(model, k=4)
    sampling = sd.TemperatureTopKTopP.make([0.0, 0.7], [0, 4], [1.0, 0.8])
    ctxs = [[1, 2], [3, 4, 5]]
    toks, probs = prop.propose(ctxs, sampling, {1: torch.Generator().manual_seed(7)})
    assert toks.shape == (2, 4) and probs.shape == (2, 4, VOCAB), (
        f"the draft proposer must return k=4 tokens and their draft distributions per request: {tuple(toks.shape)} "
        f"{tuple(probs.shape)}")
    for i in range(4):
        prefix = [ctxs[b] + toks[b, :i].tolist() for b in range(2)]
        want = sd.logits_to_probs(model(prefix), sampling)
        assert torch.allclose(probs[:, i], want), "draft probs must be the processed draft distribution"
        assert toks[0, i] == want[0].argmax(), "greedy request must draft the argmax"
        assert want[1, toks[1, i]] > 0, "sampled draft token must lie inside the top-k/top-p set"
    again, _ = prop.propose(ctxs, sampling, {1: torch.Generator().manual_seed(7)})
    assert torch.equal(again[1], toks[1]), "a seeded request must draft the same tokens"


@pytest.mark.parametrize("k, accepted", [(0, 0), (3, 0), (3, 2), (3, 3), (5, 1)])
def test_apply_verify_step_matches_table_4_1(chapter, k, accepted):
    sd = chapter("spec_decode")
    computed, total = sd.apply_verify_step(10, 11, k, accepted)
    rejected = k - accepted
    assert (computed, total) == (10 + (1 + k) - rejected, 11 + k - rejected + 1), (
        f"apply_verify_step(10, 11, {k}, {accepted}) = {(computed, total)}: rejected drafts were not rolled back or "
        "the new token not counted")
    assert total == computed + 1, "after a verify step exactly one (new) token is pending"


def test_apply_verify_step_bad_input(chapter):
    sd = chapter("spec_decode")
    with pytest.raises(ValueError, match="num_accepted"):
        sd.apply_verify_step(10, 11, 2, 3)
    with pytest.raises(ValueError, match="num_tokens"):
        sd.apply_verify_step(10, 12, 2, 1)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        sd.apply_verify_step(10, 11, -1, 0)


def test_spec_decode_metadata_layout(chapter):
    sd = chapter("spec_decode")
    meta = sd.SpecDecodeMetadata.make([[5, 6], [], [7, 8, 9]])
    assert meta.num_draft_tokens.tolist() == [2, 0, 3], (
        f"num_draft_tokens must count each request's drafts (an empty list counts 0): {meta.num_draft_tokens.tolist()}")
    assert meta.target_logits_indices.tolist() == [0, 1, 4, 5, 6], "draft rows skip each request's bonus row"
    assert meta.bonus_logits_indices.tolist() == [2, 3, 7], "bonus row is the last of each request's k + 1 rows"
