"""AsyncLLM: streams match the offline engine (core in its own process, and in a
thread), the event loop never waits for a step, abort frees blocks before the
core's next step, bad input and a dead engine fail loudly.

The tests that steer the core step by step run it in a thread of the test's
process (`multiprocess_mode=False`): the same busy loop and messages as the
core process, but its `step` can be wrapped from here."""
import asyncio
import threading

import pytest

from engine_utils import SMALL_KV, greedy, make_llm, target_path
from mini_vllm import SamplingParams
from mini_vllm.engine import EngineCoreOutputs
from mini_vllm.engine.async_llm import AsyncLLM, EngineDeadError

PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "for i in range(10):", "x = [1, 2, 3]"]


@pytest.fixture(scope="module")
def offline():
    llm = make_llm(block_size=16)
    outs = llm.generate(PROMPTS, greedy(12), use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]


def _async_llm(multiprocess_mode: bool = False) -> AsyncLLM:
    return AsyncLLM.from_engine_args(target_path(), dtype="float32", device="cpu",
                                     kv_cache_memory_bytes=SMALL_KV, block_size=16,
                                     multiprocess_mode=multiprocess_mode)


def _core(llm: AsyncLLM):
    """The core object (it runs in a thread of this process)."""
    core = llm.engine_core.engine_core
    assert core is not None, "the test needs the core in a thread (multiprocess_mode=False)"
    return core


async def _collect(llm, prompt, params, rid):
    text, toks, n_outs = "", [], 0
    async for out in llm.generate(prompt, params, rid):
        n_outs += 1
        text += out.outputs[0].text if out.outputs else ""
        toks += out.outputs[0].token_ids if out.outputs else []
    return text, toks, n_outs


@pytest.mark.parametrize("multiprocess_mode", [True, False], ids=["core-process", "core-thread"])
def test_concurrent_delta_streams_equal_offline_generate(offline, multiprocess_mode):
    async def main():
        llm = _async_llm(multiprocess_mode)
        try:
            res = await asyncio.gather(*(_collect(llm, p, greedy(12), f"r{i}") for i, p in enumerate(PROMPTS)))
            return res, (await llm.call_utility("num_free_blocks"), llm.engine.num_gpu_blocks)
        finally:
            llm.shutdown()

    res, (free, total) = asyncio.run(main())
    for (text, toks, n_outs), (want_text, want_toks), p in zip(res, offline, PROMPTS):
        assert toks == want_toks, f"{p!r}: async stream tokens differ from LLM.generate (batching or delta bug)"
        assert text == want_text, f"{p!r}: concatenated deltas differ from the offline text"
        assert n_outs >= 2, "delta outputs should stream, not arrive as one final output"
    assert free == total, "KV blocks still held after every stream finished"


def test_event_loop_keeps_running_during_steps():
    """Each step waits until the event loop has run a callback: a loop that is free
    while a step runs answers at once, whatever a step costs; a loop blocked by the
    step (or running it) cannot answer, and the 60 s wait is only a hang guard."""
    async def main():
        llm = _async_llm()
        loop = asyncio.get_running_loop()
        core = _core(llm)
        real_step = core.step
        answered = []  # per step: did the loop run a callback while the step was in progress

        def step():
            if answered and not answered[-1]:  # already failed: do not wait again
                answered.append(False)
            else:
                ping = threading.Event()
                loop.call_soon_threadsafe(ping.set)
                answered.append(ping.wait(60))
            return real_step()

        core.step = step
        try:
            await _collect(llm, "def f():", greedy(4), "steps")
        finally:
            llm.shutdown()
        return answered

    answered = asyncio.run(main())
    assert len(answered) >= 4, f"{len(answered)} steps for 4 tokens: the wrapped step was bypassed"
    assert all(answered), \
        f"the event loop did not run during steps {answered}: a step ran on, or blocked, the loop thread"


def _gate_steps(llm: AsyncLLM) -> threading.Semaphore:
    """The core takes only the steps the test releases, so how far a request gets
    between two actions of the test is fixed, not a matter of how fast a step is.
    Without a permit a step does nothing (an empty output), and the core's loop
    goes on applying the messages (add, abort) the test sends. Release a permit
    only when the core runs just the requests it is meant for: any running
    request's step may take it."""
    permits = threading.Semaphore(0)
    core = _core(llm)
    real_step = core.step
    core.step = lambda: real_step() if permits.acquire(timeout=0.01) else EngineCoreOutputs()
    return permits


async def _rest(gen) -> list:
    try:
        return await asyncio.wait_for(_drain(gen), 60)  # hang guard
    except asyncio.TimeoutError:
        pytest.fail("the stream of an aborted request never ended")


async def _drain(gen) -> list:
    return [o async for o in gen]


def test_abort_frees_blocks_at_once_and_ends_the_stream():
    async def main():
        llm = _async_llm()
        permits = _gate_steps(llm)
        try:
            gen = llm.generate("def main():", greedy(300), "long")
            permits.release(3)
            seen = 0
            async for out in gen:
                seen += len(out.outputs[0].token_ids)
                if seen >= 3:
                    break
            await gen.aclose()  # the consumer walked away: its finally aborts the request
            # No step is released meanwhile, so "long" cannot have finished by itself.
            left = sorted(llm.engine.output_processor.request_states)
            assert "long" not in left, "closing a stream (the consumer walked away) did not abort its request"
            # Messages reach the core in order, so this call sees the core after that abort.
            assert not await llm.call_utility("has_unfinished_requests"), \
                "the core still runs a request whose stream was closed (the abort never reached it)"
            gen2 = llm.generate("import sys", greedy(300), "long2")
            permits.release(1)
            await gen2.__anext__()
            await llm.abort("long2")  # a second request, aborted explicitly
            rest = await _rest(gen2)
            state = (await llm.call_utility("num_free_blocks"), llm.engine.num_gpu_blocks,
                     sorted(llm.engine.output_processor.request_states),
                     await llm.call_utility("has_unfinished_requests"))
            return rest, state
        finally:
            llm.shutdown()

    rest, (free, total, left, unfinished) = asyncio.run(main())
    assert not any(o.finished for o in rest), "an aborted stream must end without a finished output"
    assert left == [], f"abort() returned with {left} still in the engine"
    assert not unfinished, "aborted requests are still in the engine core"
    assert free == total, f"abort left {total - free} KV blocks in use"


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

        _core(llm).step = broken_step
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(llm, "def f():", greedy(3), "a"), 10)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(llm, "def g():", greedy(3), "b"), 10)
        assert not llm.is_running

    asyncio.run(main())
