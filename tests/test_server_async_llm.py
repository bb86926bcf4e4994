"""AsyncLLM in-process: streams match the offline engine, the event loop never
waits for a step, abort frees blocks at once, bad input and a dead engine fail loudly."""
import asyncio
import time

import pytest

from engine_utils import SMALL_KV, greedy, make_llm, target_path
from mini_vllm import SamplingParams
from mini_vllm.engine.async_llm import AsyncLLM, EngineDeadError

PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "for i in range(10):", "x = [1, 2, 3]"]


@pytest.fixture(scope="module")
def offline():
    llm = make_llm(block_size=16)
    outs = llm.generate(PROMPTS, greedy(12), use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]


def _async_llm() -> AsyncLLM:
    return AsyncLLM.from_engine_args(target_path(), dtype="float32", device="cpu",
                                     kv_cache_memory_bytes=SMALL_KV, block_size=16)


async def _collect(llm, prompt, params, rid):
    text, toks, n_outs = "", [], 0
    async for out in llm.generate(prompt, params, rid):
        n_outs += 1
        text += out.outputs[0].text if out.outputs else ""
        toks += out.outputs[0].token_ids if out.outputs else []
    return text, toks, n_outs


def test_concurrent_delta_streams_equal_offline_generate(offline):
    async def main():
        llm = _async_llm()
        try:
            res = await asyncio.gather(*(_collect(llm, p, greedy(12), f"r{i}") for i, p in enumerate(PROMPTS)))
            core = await llm.run_on_engine(lambda e: (e.engine_core.scheduler.kv_cache_manager.num_free_blocks,
                                                      e.engine_core.num_gpu_blocks))
            return res, core
        finally:
            llm.shutdown()

    res, (free, total) = asyncio.run(main())
    for (text, toks, n_outs), (want_text, want_toks), p in zip(res, offline, PROMPTS):
        assert toks == want_toks, f"{p!r}: async stream tokens differ from LLM.generate (batching or delta bug)"
        assert text == want_text, f"{p!r}: concatenated deltas differ from the offline text"
        assert n_outs >= 2, "delta outputs should stream, not arrive as one final output"
    assert free == total, "KV blocks still held after every stream finished"


def test_event_loop_keeps_running_during_slow_steps():
    async def main():
        llm = _async_llm()
        real_step = llm.engine.step

        def slow_step():  # a 0.3 s forward pass: only a blocked loop would stall that long
            time.sleep(0.3)
            return real_step()

        llm.engine.step = slow_step
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        t = asyncio.create_task(ticker())
        try:
            await _collect(llm, "def f():", greedy(4), "slow")
        finally:
            stop.set()
            await t
            llm.shutdown()
        return gaps

    gaps = asyncio.run(main())
    assert len(gaps) > 20, "the ticker barely ran: the event loop was blocked by engine steps"
    assert max(gaps) < 0.2, f"the event loop stalled {max(gaps):.3f} s: a step ran on the loop thread"


def test_abort_frees_blocks_at_once_and_ends_the_stream():
    async def main():
        llm = _async_llm()
        try:
            gen = llm.generate("def main():", greedy(300), "long")
            seen = 0
            async for out in gen:
                seen += len(out.outputs[0].token_ids)
                if seen >= 3:
                    break
            await gen.aclose()  # the consumer walked away: its finally aborts the request
            gen2 = llm.generate("import sys", greedy(300), "long2")
            await gen2.__anext__()
            await llm.abort("long2")  # a second request, aborted explicitly
            rest = [o async for o in gen2]
            state = await llm.run_on_engine(lambda e: (
                e.engine_core.scheduler.kv_cache_manager.num_free_blocks, e.engine_core.num_gpu_blocks,
                e.has_unfinished_requests(), e.metrics.num_generation_tokens))
            return rest, state
        finally:
            llm.shutdown()

    rest, (free, total, unfinished, n_gen) = asyncio.run(main())
    # outputs delivered before the abort took effect may still be queued; none is final
    assert all(not o.finished for o in rest) and len(rest) < 10, \
        "an aborted stream must end without a finished output"
    assert not unfinished, "aborted requests are still in the engine"
    assert free == total, f"abort left {total - free} KV blocks in use"
    assert n_gen < 100, f"{n_gen} tokens generated: the abandoned stream kept running"


def test_bad_request_raises_value_error_and_engine_keeps_serving():
    async def main():
        llm = _async_llm()
        try:
            with pytest.raises(ValueError, match="shorter than max_model_len"):
                async for _ in llm.generate(list(range(10, 1040)), SamplingParams(max_tokens=50), "big"):
                    pass
            with pytest.raises(ValueError, match="prompt_token_ids must lie in"):
                async for _ in llm.generate([10**9], SamplingParams(max_tokens=2), "oov"):
                    pass
            return await _collect(llm, "def f():", greedy(3), "ok")
        finally:
            llm.shutdown()

    text, toks, _ = asyncio.run(main())
    assert len(toks) == 3, "a valid request after two rejected ones must still be served"


def test_engine_error_fails_streams_instead_of_hanging():
    async def main():
        llm = _async_llm()

        def broken_step():
            raise RuntimeError("simulated device failure")

        llm.engine.step = broken_step
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(llm, "def f():", greedy(3), "a"), 10)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(llm, "def g():", greedy(3), "b"), 10)
        assert not llm.is_running

    asyncio.run(main())
