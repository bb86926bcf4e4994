"""The engine's user-facing behaviour: stop rules, streaming, n > 1, seeds, abort.

Oracles: the same engine's greedy run without the stop rule (the stop must
cut exactly there), requests run alone (batch invariance), and the tokenizer's
own decode (text)."""
import pytest

from engine_utils import assert_pool_full, make_llm, run_greedy
from mini_vllm import SamplingParams
from mini_vllm.engine.llm_engine import LLMEngine

PROMPT = "def __init__(self, name, value=None):\n"


@pytest.fixture(scope="module")
def llm():
    return make_llm(block_size=8, max_model_len=256)


@pytest.fixture(scope="module")
def free_run(llm):
    """The unconstrained greedy continuation of PROMPT (40 tokens)."""
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    return out


def _gen(llm, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("ignore_eos", True)
    return llm.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def test_max_tokens_finishes_with_length(llm, free_run):
    out = _gen(llm, max_tokens=7)
    assert out.token_ids == free_run.token_ids[:7] and out.finish_reason == "length", (
        f"max_tokens=7 must stop after exactly 7 greedy tokens with 'length', got {len(out.token_ids)} tokens, "
        f"{out.finish_reason}")
    assert out.stop_reason is None, f"a length finish has no stop_reason, got {out.stop_reason!r}"


def test_stop_token_id_cuts_and_is_reported(llm, free_run):
    j = 5
    t = free_run.token_ids[j]
    first = free_run.token_ids.index(t)  # the earliest occurrence is where it must stop
    out = _gen(llm, max_tokens=40, stop_token_ids=[t])
    assert out.token_ids == free_run.token_ids[:first + 1], "must stop right after the stop token id"
    assert out.finish_reason == "stop" and out.stop_reason == t, (
        f"a stop token id must finish with 'stop' and report itself as stop_reason {t}, got {out.finish_reason} "
        f"{out.stop_reason!r}")


def test_min_tokens_defers_stop_token(llm, free_run):
    t = free_run.token_ids[1]
    out = _gen(llm, max_tokens=30, stop_token_ids=[t], min_tokens=6)
    assert len(out.token_ids) >= 6, "min_tokens did not defer the stop token id"
    assert t not in out.token_ids[:6], "a stop token id was sampled before min_tokens"


def test_eos_stops_unless_ignore_eos(llm, free_run):
    eng = llm.llm_engine.processor  # it stamps the EOS id on every request
    saved = eng.eos_token_id
    eng.eos_token_id = free_run.token_ids[3]  # pretend this token is EOS
    try:
        first = free_run.token_ids.index(eng.eos_token_id)
        out = _gen(llm, max_tokens=40, ignore_eos=False)
        assert out.token_ids == free_run.token_ids[:first + 1] and out.finish_reason == "stop", (
            f"EOS (ignore_eos=False) must stop right after the first EOS with 'stop', got {len(out.token_ids)} "
            f"tokens, {out.finish_reason}")
        assert out.stop_reason is None, "EOS is not a stop_reason (vLLM reports None)"
        out = _gen(llm, max_tokens=12, ignore_eos=True)
        assert out.token_ids == free_run.token_ids[:12], "ignore_eos must not stop at EOS"
    finally:
        eng.eos_token_id = saved


def _spanning_stop(llm, free_run):
    """A 4-character stop string that starts inside one token and ends in the next."""
    tok = llm.get_tokenizer()
    pieces = [tok.decode(free_run.token_ids[:i + 1]) for i in range(len(free_run.token_ids))]
    for i in range(4, len(pieces) - 1):
        a, b = pieces[i], pieces[i + 1]
        if len(a) >= 2 and len(b) - len(a) >= 2 and b.startswith(a):
            s = a[-2:] + b[len(a):len(a) + 2]
            if s not in pieces[i - 1] and b.find(s) == len(a) - 2:
                return s, b.find(s)
    pytest.skip("no token boundary with 2+2 characters in the free run")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(llm, free_run, include):
    stop, pos = _spanning_stop(llm, free_run)
    out = _gen(llm, max_tokens=40, stop=[stop], include_stop_str_in_output=include)
    text = llm.get_tokenizer().decode(free_run.token_ids)
    want = text[:pos + len(stop)] if include else text[:pos]
    assert out.text == want, f"stop string {stop!r} spanning two tokens cut the text wrongly"
    assert out.finish_reason == "stop" and out.stop_reason == stop, (
        f"a stop string must finish with 'stop' and report itself as stop_reason, got {out.finish_reason} "
        f"{out.stop_reason!r}")
    assert_pool_full(llm)  # the engine freed the request stopped by its detokenizer


def test_streaming_deltas_concatenate_to_final_text(llm, free_run):
    stop, _ = _spanning_stop(llm, free_run)
    eng: LLMEngine = llm.llm_engine
    eng.add_request("s", PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                 stop=[stop]), output_kind="delta")
    text, toks, finals = "", [], 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            text += o.outputs[0].text if o.outputs else ""
            toks += o.outputs[0].token_ids if o.outputs else []
            finals += o.finished
    full = _gen(llm, max_tokens=40, stop=[stop])
    assert finals == 1, "a request must report finished exactly once"
    assert text == full.text and toks == full.token_ids, "streamed deltas differ from the final output"
    assert stop not in text, "streaming leaked (part of) the stop string"


def test_parallel_sampling_greedy_children_equal_single(llm, free_run):
    # top_k=1 at temperature 1 samples the argmax every time: greedy children
    # (n > 1 at temperature 0 is rejected, as in vLLM).
    out = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=15, temperature=1.0, top_k=1, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2], (
        f"n=3 must return children indexed 0, 1, 2 in order, got {[o.index for o in out.outputs]}")
    for o in out.outputs:
        assert o.token_ids == free_run.token_ids[:15], \
            f"sample {o.index} differs: a forked child read wrong KV (copy-on-write or block table)"
    assert_pool_full(llm)


def test_parallel_sampling_seeded_children_equal_separate_requests(llm):
    """Child i of a seeded n-request samples with seed + i (vLLM's rule), so each
    child must equal a separate request seeded that way: this checks the fork's
    shared prompt blocks and the copy-on-write of the last one under sampling."""
    sp = dict(max_tokens=12, temperature=1.0, top_p=0.95, ignore_eos=True)
    out = llm.generate(PROMPT, SamplingParams(n=3, seed=11, **sp), use_tqdm=False)[0]
    alone = [llm.generate(PROMPT, SamplingParams(seed=11 + i, **sp), use_tqdm=False)[0].outputs[0]
             for i in range(3)]
    for o, a in zip(out.outputs, alone):
        assert o.token_ids == a.token_ids, f"forked sample {o.index} differs from a request seeded {11 + o.index}"
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "seeded siblings must differ"
    assert_pool_full(llm)


def test_fork_shares_prompt_blocks(llm):
    """n = 4 holds far fewer blocks than 4 separate copies of a long prompt."""
    prompt = list(range(200, 296))  # 96 tokens = 12 blocks of 8
    eng = llm.llm_engine
    eng.add_request("fork", {"prompt_token_ids": prompt},
                    SamplingParams(n=4, max_tokens=4, temperature=1.0, top_k=1, ignore_eos=True))
    kv = eng.engine_core.engine_core.scheduler.kv_cache_manager
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, eng.num_gpu_blocks - kv.num_free_blocks)
    assert peak < 12 * 2, f"n=4 held {peak} blocks at peak: the prompt blocks were not shared"


def test_num_cached_tokens_reports_the_prefix_hit(llm):
    """RequestOutput.num_cached_tokens is the prompt tokens served from the prefix cache when
    the request was first scheduled (vLLM's field): 0 cold, the shared full blocks warm."""
    prefix = list(range(300, 340))  # 40 tokens = 5 full blocks of 8
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    cold = llm.generate([{"prompt_token_ids": prefix + [7, 8, 9]}], sp, use_tqdm=False)[0]
    warm = llm.generate([{"prompt_token_ids": prefix + [10, 11]}], sp, use_tqdm=False)[0]
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 40), (
        f"num_cached_tokens cold/warm = {cold.num_cached_tokens}/{warm.num_cached_tokens}, want 0/40: "
        "the prefix-cache hit is not reported in the request's output")


@pytest.mark.parametrize("filters", [dict(top_k=50), dict(), dict(top_p=0.9)])
def test_seeded_request_is_batch_invariant(llm, filters):
    sp = SamplingParams(max_tokens=10, temperature=0.8, seed=1234, ignore_eos=True, **filters)
    alone = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.5, seed=99, ignore_eos=True)]
    outs = llm.generate(["import re\n", PROMPT, "x = 1\n", PROMPT], [others[0], sp, others[1], others[2]],
                        use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone, "a seeded request changed when batched with others"


@pytest.mark.parametrize("when", ["mid_prefill", "mid_decode"])
def test_abort_frees_blocks_and_spares_others(when):
    llm = make_llm(block_size=8, max_model_len=256, max_num_batched_tokens=16)
    eng = llm.llm_engine
    long_prompt = list(range(100, 190))
    other = list(range(400, 420))
    eng.add_request("victim", {"prompt_token_ids": long_prompt},
                    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    eng.add_request("other", {"prompt_token_ids": other},
                    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    steps = 2 if when == "mid_prefill" else 9  # 90 tokens at 16 per step: prefill ends in step 6
    for _ in range(steps):
        eng.step()
    victim = eng.engine_core.engine_core.scheduler.requests["victim"]
    mid_prefill = victim.num_computed_tokens < len(long_prompt)
    assert mid_prefill == (when == "mid_prefill"), "test set-up did not reach the intended phase"
    eng.abort_request("victim")
    assert "victim" not in eng.engine_core.engine_core.scheduler.kv_cache_manager._req_blocks, "abort kept blocks"
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id != "victim", "an aborted request produced output"
            if o.finished:
                final = o
    assert final.outputs[0].token_ids == run_greedy(make_llm(), [other], 20)[0], (
        "aborting the victim changed the other request's greedy tokens (its blocks freed while shared, or the batch "
        "rows shifted?)")
    assert_pool_full(llm)
