"""Asynchronous scheduling (vLLM's `async_scheduling`, seed 001 §4.6.1): the core
schedules step N + 1 before step N's tokens are back, with a placeholder for
each token in flight, and must give exactly the tokens of synchronous
scheduling: greedy and seeded, through batching, chunked prefill, prefix
caching, recompute and swap preemption, stop tokens, stop strings, n > 1,
penalties, logprobs, structured outputs and aborts; with the core in this
process and in its own.

Oracle: the same requests on the same engine settings with
async_scheduling=False. No assertion depends on how fast anything runs: the
overlap is checked from the order of the core's own timestamps (step N + 1
was scheduled before step N's update), which the batch queue fixes by
construction."""
import pytest

from engine_utils import ALWAYS_DRAFT, assert_pool_full, make_llm, model_runner
from mini_vllm import SamplingParams
from mini_vllm.course.tiny_models import model_path
from mini_vllm.sampling_params import StructuredOutputsParams
from mini_vllm.worker.async_output import DeferredOutputs

PROMPTS = [list(range(300 + 7 * i, 330 + 11 * i)) for i in range(6)]


def _params():
    return [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=20, temperature=0.8, top_k=20, top_p=0.9, seed=9, n=3),
            SamplingParams(max_tokens=28, temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                           stop=["\n\n"], min_tokens=4),
            SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(
                choice=["alpha", "beta", "gamma delta"])),
            SamplingParams(max_tokens=40, temperature=0.7, seed=11, frequency_penalty=0.4)]


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason,
              None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
             for c in o.outputs] for o in outs]


LOGPROB_ATOL = 1e-4  # fp32 noise: a step's batch differs by the rows of in-flight finishes (another GEMM shape)


def _assert_same_outputs(got, want, message: str) -> None:
    """Tokens, text, finish reasons and the logprob tokens exactly; logprob values
    within fp32 noise. Asynchronous scheduling runs a finished request's wasted
    step, so its batches can have one more row than the synchronous ones, and a
    GPU's GEMM may then round differently in the last bits."""
    assert len(got) == len(want), f"{message}: {len(got)} requests came back, {len(want)} expected"
    for i, (g_req, w_req) in enumerate(zip(got, want)):
        assert [c[:3] for c in g_req] == [c[:3] for c in w_req], f"{message} (request {i})"
        for g, w in zip(g_req, w_req):
            assert (g[3] is None) == (w[3] is None), f"{message} (request {i}: logprobs present in one run only)"
            for pos, (gd, wd) in enumerate(zip(g[3] or [], w[3] or [])):
                assert gd.keys() == wd.keys(), f"{message} (request {i}, token {pos}: other top logprob tokens)"
                gap = max(abs(gd[t] - wd[t]) for t in wd)
                assert gap <= LOGPROB_ATOL, f"{message} (request {i}, token {pos}: logprob off by {gap:.2e})"


def _run(async_scheduling, multiprocess_mode=False, **kw):
    llm = make_llm(async_scheduling=async_scheduling, multiprocess_mode=multiprocess_mode, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
        assert_pool_full(llm)
        return _summary(outs), llm
    finally:
        if multiprocess_mode:
            llm.shutdown()


VARIANTS = {
    "plain": dict(block_size=16),
    "chunked": dict(block_size=8, max_num_batched_tokens=24, max_model_len=128),
    "recompute": dict(block_size=8, max_model_len=128, num_gpu_blocks_override=14),
    "swap": dict(block_size=8, max_model_len=128, num_gpu_blocks_override=14, preemption_mode="swap",
                 num_cpu_blocks=64),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_async_scheduling_gives_the_synchronous_tokens(variant):
    kw = VARIANTS[variant]
    want, _ = _run(False, **kw)
    got, llm = _run(True, **kw)
    _assert_same_outputs(got, want, f"{variant}: asynchronous scheduling changed the outputs (a placeholder never "
                         "replaced, a token dropped for a request preempted while its step was in flight, "
                         "or a block cached with a token not yet known)")
    if variant in ("recompute", "swap"):
        n = llm.llm_engine.engine_core.call_utility("make_stats")["num_preemptions"]
        assert n > 0, f"{variant}: the tiny KV cache never preempted, so preemption was not tested"


def test_async_scheduling_in_the_core_process():
    want, _ = _run(False, **VARIANTS["recompute"])
    got, _ = _run(True, multiprocess_mode=True, **VARIANTS["recompute"])
    _assert_same_outputs(got, want, "the core process with asynchronous scheduling changed the outputs")


def test_prefix_hits_under_async_scheduling_read_only_known_tokens():
    """Multi-turn: each turn's prompt is the previous prompt + its output + a new
    message, so it should find the previous output's full blocks in the prefix
    cache. Under asynchronous scheduling a block's last token may still be in
    flight when the block fills: it is hashed once the token is known (in the
    update that brings it, since a request finishing then is never allocated
    for again), and never before (the hash covers known tokens only)."""
    def run(async_scheduling):
        llm = make_llm(block_size=8, max_model_len=256, async_scheduling=async_scheduling)
        sp = SamplingParams(max_tokens=21, temperature=0, ignore_eos=True)
        prompts, outs = [list(range(500, 540)), list(range(600, 613))], []
        for turn in range(3):
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], [sp] * len(prompts), use_tqdm=False)
            outs.append([o.outputs[0].token_ids for o in res])
            prompts = [p + o.outputs[0].token_ids + [5 + turn, 6] for p, o in zip(prompts, res)]
        stats = llm.llm_engine.engine_core.call_utility("make_stats")
        assert_pool_full(llm)
        return outs, stats["prefix_cache_hits"]

    want, hits_sync = run(False)
    got, hits_async = run(True)
    assert hits_sync > 0, "no prefix-cache hit: the test did not exercise cached blocks"
    assert got == want, "a prefix hit under asynchronous scheduling read KV of a token that was not known"
    assert hits_async == hits_sync, (
        f"asynchronous scheduling found {hits_async} cached prompt tokens, synchronous {hits_sync}: a block "
        "completed by a token that was in flight was never hashed (cached only at a next allocation that a "
        "finishing request never gets)")


def test_the_next_step_is_scheduled_before_the_last_one_is_back():
    """The point of it: with asynchronous scheduling the core schedules step N + 1
    before it updates from step N (the core's own timestamps, in order); without
    it, never."""
    def stamps(async_scheduling):
        llm = make_llm(block_size=16, async_scheduling=async_scheduling)
        eng = llm.llm_engine
        for i, p in enumerate(PROMPTS[:3]):
            eng.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(max_tokens=16, temperature=0,
                                                                            ignore_eos=True))
        got = []
        get = eng.engine_core.get_output

        def get_output():
            res = get()
            got.append(res.timestamps)
            return res

        eng.engine_core.get_output = get_output
        while eng.has_unfinished_requests():
            eng.step()
        return [t for t in got if t]

    sync, asyn = stamps(False), stamps(True)
    ahead = sum(1 for a, b in zip(asyn, asyn[1:]) if b["scheduled"] < a["updated"])
    assert ahead >= len(asyn) // 2, (f"only {ahead} of {len(asyn) - 1} steps were scheduled before the previous "
                                     "step's update: the batch queue does not schedule ahead")
    assert not any(b["scheduled"] < a["updated"] for a, b in zip(sync, sync[1:])), \
        "synchronous scheduling scheduled a step before the previous one was back"


def test_the_next_step_reads_the_last_tokens_on_the_device():
    """Without speculation a step returns before its tokens reach the host, and the
    next step is prepared while they are still pending (its input for each request
    is written on the device from the pending tokens, `worker/async_output.py`):
    otherwise the device idles for the runner's host work every step. A request
    whose sampling reads its own history (a penalty) makes the runner settle first.
    Tokens must equal synchronous scheduling's either way."""
    def run(params, async_scheduling):
        llm = make_llm(block_size=16, async_scheduling=async_scheduling)
        runner = model_runner(llm)
        pending_at_prepare = []
        prepare = runner._prepare_inputs

        def spy(so):
            pending_at_prepare.append(isinstance(runner.outputs, DeferredOutputs) and runner.outputs.pending is not None)
            return prepare(so)

        runner._prepare_inputs = spy
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], [params] * 3, use_tqdm=False)
        assert_pool_full(llm)
        return [o.outputs[0].token_ids for o in outs], pending_at_prepare

    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want, _ = run(plain, False)
    got, pending = run(plain, True)
    assert got == want, "tokens fed back on the device differ from synchronous scheduling's"
    assert sum(pending) >= len(pending) - 2, (
        f"only {sum(pending)} of {len(pending)} steps were prepared while the previous step's tokens were "
        "pending: the runner waits for each step's tokens on the host before it prepares the next")
    penalised = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    want, _ = run(penalised, False)
    got, pending = run(penalised, True)
    assert got == want, "a penalised request under asynchronous scheduling sampled without its latest token"
    assert not any(pending), "a step whose sampling reads the token history was prepared before settling"


def test_abort_while_a_step_is_in_flight_frees_everything():
    llm = make_llm(block_size=8, max_model_len=128, async_scheduling=True)
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(str(i), {"prompt_token_ids": p}, sp)
    for _ in range(5):
        eng.step()
    core = eng.engine_core.engine_core
    assert core.batch_queue, "no batch in flight: the abort would not race a step"
    eng.abort_request(["0", "2"])
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert sorted(done) == ["1", "3"], f"aborted requests came back, or others were lost: {sorted(done)}"
    ref = make_llm(block_size=8, max_model_len=128)
    want = ref.generate([{"prompt_token_ids": PROMPTS[i]} for i in (1, 3)], [sp, sp], use_tqdm=False)
    assert [done["1"], done["3"]] == [o.outputs[0].token_ids for o in want], \
        "an abort during an in-flight step changed the other requests' tokens"
    while core.batch_queue:  # drain the wasted steps of the aborted requests
        eng.engine_core.get_output()
    assert_pool_full(llm)
    assert all(r.num_output_placeholders == 0 for r in core.scheduler.requests.values()), (
        "a placeholder outlived the drained steps: a step in flight when its request was aborted must still give "
        "its placeholder back")


def test_finished_rows_are_freed_before_a_full_batch_of_new_requests():
    """Requests finishing one per step leave the last schedules empty; each still
    carries finished_req_ids, the runner's only word to free those rows. A core
    that drops an empty schedule keeps stale rows, and the next max_num_seqs new
    requests overflow the persistent batch (found on an H100 by `make gpu-check`:
    a warm-up, then 256 requests at max_num_seqs=256)."""
    llm = make_llm(async_scheduling=True, max_num_seqs=4, max_model_len=128)
    runner = model_runner(llm)
    sync = make_llm(max_num_seqs=4, max_model_len=128)
    for rnd in range(3):
        prompts = [{"prompt_token_ids": [1 + i + 10 * rnd, 2, 3]} for i in range(4)]
        params = [SamplingParams(max_tokens=1 + i, temperature=0, ignore_eos=True) for i in range(4)]
        got = llm.generate(prompts, params, use_tqdm=False)
        want = sync.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want], \
            f"round {rnd}: a batch after finished requests gave other tokens than synchronous scheduling"
        assert runner.input_batch.num_reqs <= 1, (
            f"round {rnd}: {runner.input_batch.num_reqs} rows still held after every request finished: an empty "
            "schedule's finished_req_ids never reached the runner")
    assert_pool_full(llm)


def test_async_scheduling_refuses_what_it_cannot_do():
    """As vLLM 0.32: speculation with a known draft length (a draft model) runs
    asynchronously; the n-gram lookup, whose drafts may be fewer or none, does not."""
    for kw, field in ((dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                       "speculative_config"), (dict(tensor_parallel_size=2), "tensor_parallel_size")):
        with pytest.raises(ValueError, match=field):
            make_llm(async_scheduling=True, **kw)


DRAFT_SPEC = {"method": "draft_model", "model": str(model_path("tiny-py-draft")), "num_speculative_tokens": 3,
              **ALWAYS_DRAFT}


def _spec_params():
    """Greedy requests get drafts; a seeded one and one asking for logprobs do not (the
    verifier could not reproduce them), so both kinds share every batch."""
    return [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=33, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=36, temperature=0, ignore_eos=True, logprobs=1),
            SamplingParams(max_tokens=29, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=41, temperature=0, stop_token_ids=[7], ignore_eos=False)]


@pytest.mark.parametrize("variant", ["plain", "chunked", "recompute"])
def test_async_scheduling_with_a_draft_model(variant):
    """Asynchronous scheduling with speculative decoding: each step is scheduled with
    k placeholder drafts for every request whose previous step is in flight, and the
    runner fills them with the drafts it proposed after that step, at the positions
    that step's verification left (the scheduler learns of the rejections a step
    later). Tokens must equal synchronous speculation's, and greedy ones the plain
    engine's; drafts must really be accepted and rejected, so both corrections run."""
    kw = dict(VARIANTS[variant], speculative_config=DRAFT_SPEC)
    runs = {}
    for mode in (False, True):
        llm = make_llm(async_scheduling=mode, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _spec_params(), use_tqdm=False)
        assert_pool_full(llm)
        runs[mode] = (_summary(outs), llm.llm_engine.engine_core.call_utility("spec_decoding_stats"))
    (want, sync_stats), (got, stats) = runs[False], runs[True]
    _assert_same_outputs(got, want, f"{variant}: asynchronous speculation changed the outputs (drafts read at the "
                         "scheduler's optimistic positions instead of the ones verification left, the runner's own "
                         "drafts not used for the placeholders, or rejected placeholders never subtracted)")
    assert 0 < stats["num_accepted"] < stats["num_drafts"], \
        f"{variant}: drafts were all accepted or all rejected ({stats}): the rejection path was not exercised"
    plain = make_llm(async_scheduling=False, **VARIANTS[variant])
    greedy = [p for p in _spec_params() if p.temperature == 0]
    prompts = [{"prompt_token_ids": p} for p, sp in zip(PROMPTS, _spec_params()) if sp.temperature == 0]
    base = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    got_greedy = [g[0][0] for g, sp in zip(got, _spec_params()) if sp.temperature == 0]
    assert got_greedy == base, f"{variant}: greedy tokens under asynchronous speculation differ from no speculation"


def test_async_scheduling_default_is_decided_as_vllm_decides():
    """None (the default) is on for CUDA unless an incompatible option is set, off on
    a CPU (vLLM 0.32's CPU platform turns it off); an explicit bool is kept."""
    from mini_vllm.config import EngineConfig
    from mini_vllm.course.tiny_models import model_path
    from mini_vllm.entrypoints.cli import _engine_kwargs, build_parser

    m = str(model_path("tiny-py-target"))
    cases = [(dict(device="cpu"), False, "a CPU engine scheduled asynchronously by default (vLLM's CPU "
                                         "platform turns it off)"),
             (dict(device="cuda"), True, "a CUDA engine not scheduled asynchronously by default"),
             (dict(device="cuda", speculative_config={"method": "ngram", "num_speculative_tokens": 2}), False,
              "the CUDA default turned async scheduling on with n-gram speculation, which it cannot run"),
             (dict(device="cuda", speculative_config=DRAFT_SPEC), True,
              "the CUDA default left async scheduling off with a draft model, which it runs (as vLLM)"),
             (dict(device="cuda", tensor_parallel_size=2), False,
              "the CUDA default turned async scheduling on with two ranks"),
             (dict(device="cpu", async_scheduling=True), True, "an explicit async_scheduling=True was dropped"),
             (dict(device="cuda", async_scheduling=False), False, "an explicit async_scheduling=False was dropped")]
    for kw, want, bug in cases:
        assert EngineConfig(model=m, **kw).async_scheduling is want, f"{kw}: {bug}"
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model=m, async_scheduling="yes")
    base = ["serve", m]
    for flags, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        got = _engine_kwargs(build_parser().parse_args(base + flags))["async_scheduling"]
        assert got is want, f"CLI {flags or 'without the flag'} gave async_scheduling={got!r}, want {want!r}"
