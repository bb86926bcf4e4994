"""Structured outputs (xgrammar): every constrained output satisfies its
constraint, and unconstrained requests in the same batch are unchanged.

Oracles: `json` + `jsonschema` for JSON, Python's `re.fullmatch` for regexes
and for a regex equivalent to the EBNF grammar, membership for choices, the
engine's own output without the constrained neighbours for the unconstrained
rows, a grammar matcher the test compiles itself (xgrammar's, apart from the
engine's backend) that must accept every emitted token, and xgrammar's own
`apply_token_bitmask_inplace` for the sampler's bitmask.

The tiny model is a trained toy, and which greedy path it takes is a near-tie
that the CPU's kernels may flip. So no test relies on the model choosing to
end its text: a bounded constraint (its language finite, every string shorter
than MAX_TOKENS tokens) must end with "stop" whatever the model prefers, and
the unbounded one (any JSON object) either ends and parses, or fills
max_tokens with tokens the independent matcher accepts.
"""
import json
import re

import jsonschema
import pytest
import torch

from engine_utils import ALWAYS_DRAFT, assert_pool_full, make_llm, target_path
from mini_vllm import SamplingParams
from mini_vllm.sample.sampler import apply_token_bitmask, unpack_token_bitmask
from mini_vllm.sampling_params import StructuredOutputsParams as SO

# Bounded: a name of at most 12 characters (no escapes in xgrammar's string rule), an
# age of at most 3 digits, at most 3 one-letter tags. The longest output is
# {"name":"<12 chars of <= 4 UTF-8 bytes>","age":150,"tags":["a","b","a"]}: 90 bytes.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b"]}}}}
REGEX = r"[a-z]{2,6}_[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "def " name "(" name "):"\nname ::= [a-z]{1,8}'
GRAMMAR_RE = r"def [a-z]{1,8}\([a-z]{1,8}\):"
# The tokenizer is byte-level BPE (every token at least one byte), so a bounded constraint's
# longest string (90 bytes, the schema's) plus its end token fits: it must end with "stop".
MAX_TOKENS = 96
PROMPTS = ["kwargs = ", "x = json.loads(s)\ny = "]
CONSTRAINTS = {  # name: (params, full-text check, bounded)
    "json": (SO(json=SCHEMA, disable_any_whitespace=True), lambda t: jsonschema.validate(json.loads(t), SCHEMA), True),
    "json_object": (SO(json_object=True, disable_any_whitespace=True),
                    lambda t: isinstance(json.loads(t), dict) or pytest.fail(f"not an object: {t!r}"), False),
    "regex": (SO(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(f"{t!r} !~ {REGEX}"), True),
    "choice": (SO(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(f"{t!r} not in {CHOICES}"), True),
    "grammar": (SO(grammar=GRAMMAR), lambda t: re.fullmatch(GRAMMAR_RE, t) or pytest.fail(f"{t!r} !~ grammar"), True),
}


def _sp(temperature, **kw):
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature,
                          seed=None if temperature == 0 else 7, **kw)


class IndependentMatcher:
    """xgrammar compiled here from the constraint itself, not through the engine's
    backend: a choice becomes an EBNF written out by hand, JSON uses vLLM's compact
    separators as disable_any_whitespace asks."""

    def __init__(self, vocab_size: int):
        self.xgr = pytest.importorskip("xgrammar")
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(target_path(), local_files_only=True)
        self.info = self.xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)

    def grammar(self, name: str):
        x = self.xgr
        compact = dict(any_whitespace=False, separators=(",", ":"))
        return {"json": lambda: x.Grammar.from_json_schema(json.dumps(SCHEMA), **compact),
                "json_object": lambda: x.Grammar.from_json_schema('{"type": "object"}', **compact),
                "regex": lambda: x.Grammar.from_regex(REGEX),
                "choice": lambda: x.Grammar.from_ebnf('root ::= "yes" | "no" | "maybe so"'),
                "grammar": lambda: x.Grammar.from_ebnf(GRAMMAR)}[name]()

    def check(self, name: str, completion) -> None:
        """Every emitted token is one the constraint allowed at that point; an output
        that ended with "stop" ended where the constraint may end."""
        x = self.xgr
        m = x.GrammarMatcher(x.GrammarCompiler(self.info, max_threads=1).compile_grammar(self.grammar(name)))
        for k, t in enumerate(completion.token_ids):
            assert m.accept_token(int(t)), (
                f"{name}: output token {k} ({t}) is not allowed by the constraint after {completion.token_ids[:k]}: "
                "the bitmask row was another request's, stale, or not applied")
        if completion.finish_reason == "stop":
            assert m.is_terminated(), f"{name}: stopped where the constraint cannot end: {completion.text!r}"


def test_constrained_outputs_valid_and_neighbours_unchanged():
    llm = make_llm(block_size=8)
    plain = [({"prompt_token_ids": [5, 6, 7, 8]}, _sp(0, ignore_eos=True)),
             ({"prompt_token_ids": [9, 10, 11]}, _sp(1.0, ignore_eos=True))]
    alone = [o.outputs[0].token_ids for o in llm.generate([p for p, _ in plain], [s for _, s in plain],
                                                          use_tqdm=False)]
    reqs = list(plain)
    for so, _, _ in CONSTRAINTS.values():
        for temp in (0.0, 1.0):
            reqs += [(p, _sp(temp, structured_outputs=so)) for p in PROMPTS]
    outs = llm.generate([p for p, _ in reqs], [s for _, s in reqs], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone, \
        "unconstrained requests changed when batched with constrained ones (the bitmask leaked to other rows)"
    matcher = IndependentMatcher(llm.llm_engine.model_config.vocab_size)
    i = 2
    for name, (_, check, bounded) in CONSTRAINTS.items():
        for temp in (0.0, 1.0):
            for _ in PROMPTS:
                c = outs[i].outputs[0]
                i += 1
                matcher.check(name, c)
                if bounded or c.finish_reason == "stop":
                    assert c.finish_reason == "stop", (
                        f"{name} t={temp}: a bounded constraint did not end within {MAX_TOKENS} tokens "
                        f"(the end token masked out after the grammar completed?): {c.text!r}")
                    check(c.text)
                else:
                    assert c.finish_reason == "length" and len(c.token_ids) == MAX_TOKENS, \
                        f"{name} t={temp}: ended neither by its grammar nor at max_tokens: {c.finish_reason}"
    assert_pool_full(llm)


def test_unconstrained_text_would_fail_the_checks():
    """The constraints must bite: the tiny model's free text breaks each one."""
    llm = make_llm(block_size=8)
    outs = llm.generate(PROMPTS, _sp(0), use_tqdm=False)
    for name, (_, check, _) in CONSTRAINTS.items():
        for o in outs:
            with pytest.raises(BaseException):
                check(o.outputs[0].text)


def test_speculative_decoding_serves_constrained_requests_without_drafts():
    """Constrained requests get no drafts (spec_decode.engine.verifier.spec_eligible): the grammar
    applies to every token, and greedy output equals the run without speculation."""
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=so)
    want = make_llm(block_size=8).generate(PROMPTS, sp, use_tqdm=False)
    spec = make_llm(block_size=8, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          **ALWAYS_DRAFT})
    got = spec.generate(PROMPTS, sp, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want], (
        "speculative decoding changed the constrained greedy text: drafts slipped past the grammar or the bitmask "
        "rows were shifted by the draft rows")
    for o in got:
        assert o.outputs[0].finish_reason == "stop", f"the bounded schema did not end: {o.outputs[0].text!r}"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert spec.llm_engine.engine_core.call_utility("spec_decoding_stats")["num_drafts"] == 0, \
        "a constrained request was given drafts that the grammar never checked"


@pytest.mark.parametrize("vocab", [64, 6144, 70])
def test_bitmask_matches_xgrammar_kernel(vocab):
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # a row with every bit set (bit 31 is the sign) stays untouched
    bitmask[1, 0] = -2**31  # only token 31 of the first word
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    got = logits.masked_fill(~unpack_token_bitmask(bitmask, vocab), float("-inf"))  # the path without xgrammar
    assert torch.equal(got, want), "bit j of word w must allow token 32 w + j, as xgrammar lays it out"
    assert torch.equal(got[0], logits[0]), (
        "a bitmask row of all ones (-1, sign bit included) must leave every logit as it was: bit 31 (the sign) "
        "taken as a disallowed token?")
    assert torch.equal(apply_token_bitmask(logits, bitmask), want) and not torch.equal(want, logits), \
        "the sampler's bitmask step must not modify the caller's logits"


def test_bad_constraints_raise_naming_the_field():
    llm = make_llm()
    for so, field in [(SO(regex="(a"), "structured_outputs.regex"),
                      (SO(json={"type": "no-such-type"}), "structured_outputs.json"),
                      (SO(grammar="root ::= undefined_rule"), "structured_outputs.grammar")]:
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=so), use_tqdm=False)
    for kw in [dict(regex="a", choice=["b"]), dict()]:
        with pytest.raises(ValueError, match="exactly one of"):
            SO(**kw)
    with pytest.raises(ValueError, match="unsupported field"):
        SamplingParams(structured_outputs={"regex": "a", "whitespace_pattern": " "})
    assert_pool_full(llm)


def test_ignore_eos_after_the_grammar_ends_emits_only_stop_tokens():
    """Past its end a grammar allows only the stop tokens, so ignore_eos pads
    with EOS instead of writing past the constraint."""
    llm = make_llm()
    eos = llm.llm_engine.eos_token_id
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True,
                                                  structured_outputs=SO(choice=CHOICES)), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text in CHOICES and c.finish_reason == "length", c.text
    first_eos = c.token_ids.index(eos)
    assert c.token_ids[first_eos:] == [eos] * (12 - first_eos), "tokens after the grammar's end must all be EOS"


# Prompts after which the tiny model, free to put whitespace between JSON tokens, tends to.
WHITESPACE_PROMPTS = ["data = {", "x = ", "import json\nobj = ", "result = "]
# Bounded: the longest output, {"name":"<12 chars of <= 4 bytes>","age":150}, is 69 bytes.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def _outside_strings(text: str) -> str:
    return re.sub(r'"[^"]*"', '""', text)


def test_disable_any_whitespace_ends_the_tiny_models_whitespace_runs():
    """vLLM's disable_any_whitespace (xgrammar's any_whitespace=False): without it the
    grammar allows whitespace anywhere between tokens and the tiny model spends tokens
    on it (given enough, it spends all of max_tokens, and a cut output need not parse,
    as in vLLM); with it, no whitespace appears outside strings, and the bounded schema
    closes its object and validates."""
    llm = make_llm()

    def run(compact):
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=SO(json=PERSON,
                            disable_any_whitespace=compact))
        return [o.outputs[0] for o in llm.generate(WHITESPACE_PROMPTS, sp, use_tqdm=False)]

    loose = run(False)
    assert any(re.search(r"\s", _outside_strings(c.text)) for c in loose), (
        "disable_any_whitespace=False gave compact JSON for every prompt: the flag is not passed to the "
        f"grammar, or is inverted: {[c.text for c in loose]}")
    for p, c in zip(WHITESPACE_PROMPTS, loose):
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), PERSON)
    for p, c in zip(WHITESPACE_PROMPTS, run(True)):
        assert c.finish_reason == "stop", f"{p!r}: disable_any_whitespace did not stop the run: {c.text!r}"
        assert not re.search(r"\s", _outside_strings(c.text)), \
            f"{p!r}: whitespace outside strings although it was disabled: {c.text!r}"
        jsonschema.validate(json.loads(c.text), PERSON)
    assert_pool_full(llm)
