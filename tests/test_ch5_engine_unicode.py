"""Non-ASCII output through the engine: characters of 2, 3 and 4 UTF-8 bytes,
each split over byte-level tokens, streamed as deltas.

The model is the cycle checkpoint of tests/text_models.py, whose greedy output
repeats "é中😀\\n" (10 tokens, 9 of them single bytes that decode to U+FFFD
alone). Oracle: the tokenizer's decode of all output ids at once.
"""
import pytest

from engine_utils import assert_pool_full, make_llm
from mini_vllm import SamplingParams
from text_models import write_cycle_model

TEXT = "é中😀\n"
PROMPT = "# " + TEXT


@pytest.fixture(scope="module")
def cycle_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("cycle_model")
    cycle = write_cycle_model(path, TEXT)
    return make_llm(str(path), block_size=8, max_model_len=128), cycle


def _stream(llm, sp):
    eng = llm.llm_engine
    eng.add_request("u", PROMPT, sp, output_kind="delta")
    deltas, toks = [], []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.outputs:
                deltas.append(o.outputs[0].text)
                toks += o.outputs[0].token_ids
    return deltas, toks


def test_streamed_multibyte_characters_equal_the_full_decode(cycle_llm):
    llm, cycle = cycle_llm
    tok = llm.get_tokenizer()
    assert sum(tok.decode([t]) == "\ufffd" for t in cycle) == 9, \
        "set-up: every byte of é, 中 and 😀 must be a token of its own"
    sp = SamplingParams(max_tokens=2 * len(cycle), temperature=0, ignore_eos=True)
    deltas, toks = _stream(llm, sp)
    assert toks == cycle * 2, "set-up: the cycle model must repeat its text"
    full = tok.decode(toks)
    assert full == TEXT * 2, f"set-up: the tokenizer must decode the two cycles to the text twice, got {full!r}"
    bad = [d for d in deltas if "\ufffd" in d]
    assert not bad, (f"streamed deltas {bad} hold U+FFFD: the detokenizer emitted text for an incomplete "
                     "multi-byte UTF-8 character instead of holding it back until its last byte")
    assert "".join(deltas) == full, (f"streamed deltas {deltas} do not concatenate to the full decode "
                                     f"{full!r} of the output ids")
    whole = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert whole.text == full, f"non-streamed text {whole.text!r} differs from the full decode {full!r}"
    assert_pool_full(llm)


@pytest.mark.parametrize("stop, want", [("中", "é"), ("😀\né", "é中"), ("\n", "é中😀")])
def test_non_ascii_stop_string_cuts_at_a_character(cycle_llm, stop, want):
    """A stop string that starts or ends inside a multi-byte character's tokens."""
    llm, cycle = cycle_llm
    sp = SamplingParams(max_tokens=3 * len(cycle), temperature=0, ignore_eos=True, stop=[stop])
    deltas, _ = _stream(llm, sp)
    assert "".join(deltas) == want, (f"stop string {stop!r}: streamed {''.join(deltas)!r}, want {want!r} "
                                     "(text before the first match, no replacement characters)")
    assert llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].text == want, (
        f"stop string {stop!r}: the non-streamed text must also be cut before the first match, to {want!r}")
    assert_pool_full(llm)


def test_fast_decode_path_gives_the_tokenizers_text():
    """The detokenizer calls the Rust tokenizer directly where that is what
    `tokenizer.decode` does (engine/detokenizer.py:fast_decoder). On random id
    windows (multi-byte characters cut anywhere, special tokens kept or
    skipped) it must return exactly tokenizer.decode's text, and a tokenizer
    that cleans up spaces must keep the slow path."""
    import random

    from transformers import AutoTokenizer

    from mini_vllm.course.tiny_models import model_path
    from mini_vllm.engine.detokenizer import IncrementalDetokenizer, fast_decoder

    tok = AutoTokenizer.from_pretrained(str(model_path("tiny-py-target")))
    fast = fast_decoder(tok)
    assert fast is not None, "a transformers fast tokenizer without space clean-up must get the fast path"
    ids = tok.encode("é中😀 naïve — ∑ x² <|endoftext|> done", add_special_tokens=False) + list(tok.all_special_ids)
    rng = random.Random(0)
    for _ in range(300):
        window = [rng.choice(ids + list(range(len(tok)))) for _ in range(rng.randint(0, 8))]
        for skip in (True, False):
            assert fast(window, skip_special_tokens=skip) == tok.decode(window, skip_special_tokens=skip), \
                f"fast decode differs from tokenizer.decode on {window} (skip_special_tokens={skip})"
    tok.clean_up_tokenization_spaces = True
    assert fast_decoder(tok) is None, "a tokenizer that cleans up spaces must keep tokenizer.decode"
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    assert det._fast is None, (
        "IncrementalDetokenizer took the fast path for a tokenizer that cleans up spaces (its text would differ)")
