"""logit_bias, allowed_token_ids and bad_words in the engine's sampler,
against hand-modified Hugging Face logits.

Oracle: a greedy loop over HF's fp32 logits of the last position, changed the
way vLLM defines each control (bias added; every token outside the allowed
set at -inf; a bad word's last token at -inf when the output already ends with
the word's other tokens), then argmax. The engine serves all four requests
(three controls and a plain one) in one batch; with logprobs_mode
"processed_logprobs" its logprobs are the log-softmax of the changed logits.
"""
import pytest
import torch

from engine_utils import assert_pool_full, make_llm
from mini_vllm import SamplingParams
from mini_vllm.course.tiny_models import load_tiny_model, load_tiny_tokenizer

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return"
STEPS = 10


@pytest.fixture(scope="module")
def hf():
    return load_tiny_model("tiny-py-target", dtype=torch.float32)


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


def _hf_loop(hf, prompt, change):
    """Greedy tokens and the changed log-softmax rows; change(logits, output) edits in place."""
    seq, out, rows = list(prompt), [], []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = hf(torch.tensor([seq])).logits[0, -1].float().clone()
            change(logits, out)
            rows.append(logits.log_softmax(-1))
            t = int(logits.argmax())
            out.append(t)
            seq.append(t)
    return out, rows


def _bad_word_ids(tok, word):
    """vLLM's tokenization of a bad word: alone, and after a space when that is a
    different first token and as many tokens."""
    plain = tok.encode(word.lstrip(), add_special_tokens=False)
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    return [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])


def test_token_controls_match_modified_hf_logits(hf, tok):
    prompt = tok(PROMPT)["input_ids"]
    free, _ = _hf_loop(hf, prompt, lambda lg, out: None)
    # Controls aimed at what the model would otherwise say, so each one bites.
    bias = {free[0]: -100.0, free[1]: 7.5, 290: 3.0}
    allowed = sorted({free[2], free[4], 290, 11, 12, 13, 262, 371, 629, 346})
    one_token, two_tokens = tok.decode([free[3]]), tok.decode(free[5:7])  # "def", "power" here
    assert _bad_word_ids(tok, two_tokens)[0] == free[5:7], \
        "the two-token bad word must tokenize as the model emits it, so the prefix rule bites"

    def add_bias(lg, out):
        for t, b in bias.items():
            lg[t] += b

    def only_allowed(lg, out):
        mask = torch.ones_like(lg, dtype=torch.bool)
        mask[allowed] = False
        lg[mask] = float("-inf")

    def ban(words):
        bans = [ids for w in words for ids in _bad_word_ids(tok, w)]

        def change(lg, out):
            for b in bans:
                if len(b) == 1 or out[len(out) - len(b) + 1:] == b[:-1]:
                    lg[b[-1]] = float("-inf")
        return change

    cases = [(dict(logit_bias=bias), add_bias), (dict(allowed_token_ids=allowed), only_allowed),
             (dict(bad_words=[one_token]), ban([one_token])), (dict(bad_words=[two_tokens]), ban([two_tokens])),
             ({}, lambda lg, out: None)]
    llm = make_llm(block_size=8, logprobs_mode="processed_logprobs")
    params = [SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=3, **kw) for kw, _ in cases]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(cases), params, use_tqdm=False)
    for (kw, change), o in zip(cases, outs):
        name = next(iter(kw), "plain")
        want, rows = _hf_loop(hf, prompt, change)
        c = o.outputs[0]
        assert c.token_ids == want, f"{name}: engine tokens differ from HF logits changed by hand\n" \
                                    f"engine {c.token_ids}\nhf     {want}"
        for step, (d, row) in enumerate(zip(c.logprobs, rows)):
            top_v, top_i = row.topk(3)
            for i, v in zip(top_i.tolist(), top_v.tolist()):
                assert d[i].logprob == pytest.approx(v, abs=1e-4), \
                    f"{name} step {step}: logprobs are not the changed distribution's"
    for i in range(4):  # otherwise the comparison could not tell a control from no control
        assert outs[i].outputs[0].token_ids != free, f"control {i} must change the greedy output"
    assert set(outs[1].outputs[0].token_ids) <= set(allowed), (
        f"allowed_token_ids let other tokens through: {sorted(set(outs[1].outputs[0].token_ids) - set(allowed))}")
    assert outs[4].outputs[0].token_ids == free, (
        "a control leaked into the plain request batched with it (a bias, mask or ban applied to the wrong row)")
    assert_pool_full(llm)


def test_bad_values_name_the_field(tok):
    llm = make_llm()
    for kw, field in [(dict(logit_bias={6144: 1.0}), "logit_bias"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
                      (dict(allowed_token_ids=[6144]), "allowed_token_ids"), (dict(bad_words=[" "]), "bad_words"),
                      (dict(logit_bias={1: float("inf")}), "logit_bias")]:
        with pytest.raises(ValueError, match=field):
            llm.generate("x", SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    assert SamplingParams(logit_bias={"5": 500}).logit_bias == {5: 100.0}, "vLLM clamps biases to [-100, 100]"
