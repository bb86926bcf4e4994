"""The engine core in its own process (vLLM's `EngineCoreProc` behind `SyncMPClient`):
the same outputs as in-process, a dead core raises instead of hanging, and no
process is ever left behind.

Every wait on the core is bounded by a hang guard far above any step time; no
assertion depends on how fast the core runs."""
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch

from engine_utils import SMALL_KV, make_llm, target_path
from fault_server import FAULT_MARKER, MarkerFaultExecutor
from mini_vllm import LLM, SamplingParams
from mini_vllm.engine import EngineCoreOutputs, EngineCoreRequest
from mini_vllm.engine.exceptions import EngineDeadError
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.scheduler import EngineCoreOutput
from mini_vllm.serial_utils import MsgpackDecoder, MsgpackEncoder
from server_utils import pid_alive

PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "for i in range(10):"]
HANG_GUARD_S = 120
PROGRAMS = Path(__file__).resolve().parent / "programs"


def _wait_gone(pid: int) -> bool:
    for _ in range(HANG_GUARD_S * 10):
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


def _summary(outs):
    return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted((t, round(lp.logprob, 5)) for t, lp in d.items())
                                               for d in c.logprobs]) for c in o.outputs] for o in outs]


def test_core_process_gives_the_in_process_outputs():
    """Greedy, seeded n=3 with logprobs, stop strings and prompt logprobs: the core
    in its own process (which steps on while this process detokenizes, and learns
    of stop strings one step late) gives exactly what the in-process core gives."""
    params = [SamplingParams(max_tokens=24, temperature=0, logprobs=2, prompt_logprobs=1),
              SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3, logprobs=1),
              # The greedy request repeats "1 1 ..." on the tiny target: its stop string fires whatever
              # the sampler's noise; the seeded one stops at the first line break or colon.
              SamplingParams(max_tokens=40, temperature=0, stop=["1 1"], include_stop_str_in_output=True),
              SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=3, stop=[":", "\n"])]
    here = make_llm(block_size=16, multiprocess_mode=False)
    want = here.generate(PROMPTS, params, use_tqdm=False)
    there = make_llm(block_size=16, multiprocess_mode=True)
    try:
        assert there.llm_engine.engine_core.proc.pid != os.getpid(), (
            "multiprocess_mode=True must run the engine core in its own process, not in this one")
        got = there.generate(PROMPTS, params, use_tqdm=False)
        assert _summary(got) == _summary(want), "the core process changed the outputs (lost, reordered or " \
                                                "extra tokens after a stop string, or logprobs garbled in transit)"
        assert [o.prompt_logprobs for o in got[:1]] == [o.prompt_logprobs for o in want[:1]], \
            "prompt logprobs differ across the process boundary"
        assert all(c.finish_reason == "stop" for o in got[2:] for c in o.outputs), \
            "a request with a stop string ran to max_tokens: the test did not exercise stop strings"
        free = there.llm_engine.engine_core.call_utility("num_free_blocks")
        assert free == there.llm_engine.num_gpu_blocks, "the core process leaked KV blocks (a stop-string abort lost)"
    finally:
        there.shutdown()


def test_core_that_raises_fails_generate_and_exits_with_status_1():
    llm = make_llm(block_size=16, multiprocess_mode=True, executor_class=MarkerFaultExecutor)
    proc = llm.llm_engine.engine_core.proc
    try:
        assert llm.generate(["def f():"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids, (
            "the faulty executor must serve an ordinary request before its planted fault: the test set-up is broken")
        box = []
        t = threading.Thread(target=lambda: box.append(_raises(llm)), daemon=True)
        t.start()
        t.join(HANG_GUARD_S)
        assert not t.is_alive(), "LLM.generate hung after its engine core raised"
        assert isinstance(box[0], EngineDeadError) and "PlantedFault" in str(box[0]), \
            f"generate must raise EngineDeadError naming the core's exception, got {box[0]!r}"
        proc.join(HANG_GUARD_S)
        # The client's monitor thread reaps the process too; whichever waitpid loses
        # sees no status for a moment, so read it until the winner has stored it.
        for _ in range(HANG_GUARD_S * 10):
            if proc.exitcode is not None:
                break
            time.sleep(0.1)
        assert proc.exitcode == 1, f"a core whose step raised must exit with status 1, got {proc.exitcode}"
        with pytest.raises(EngineDeadError):
            llm.generate(["def g():"], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()


def _raises(llm):
    try:
        llm.generate([{"prompt_token_ids": FAULT_MARKER}, "def h():"], SamplingParams(max_tokens=50),
                     use_tqdm=False)
    except BaseException as e:  # noqa: BLE001
        return e
    return None


def test_killed_core_process_raises_in_step_instead_of_hanging():
    eng = LLMEngine.from_engine_args(target_path(), dtype="float32", device="cpu", kv_cache_memory_bytes=SMALL_KV,
                                     block_size=16, multiprocess_mode=True)
    pid = eng.engine_core.proc.pid
    try:
        eng.add_request("long", "def main():", SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        assert eng.step() is not None, (
            "setup: step() on the live core process must return its list of outputs, not None")
        os.kill(pid, signal.SIGKILL)
        box = []

        def drain():
            try:
                for _ in range(10_000):  # outputs already sent come first, then the error
                    eng.step()
                box.append(None)
            except BaseException as e:  # noqa: BLE001
                box.append(e)

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        t.join(HANG_GUARD_S)
        assert not t.is_alive(), "LLMEngine.step hung after its core process was killed"
        assert isinstance(box[0], EngineDeadError) and "status -9" in str(box[0]), \
            f"step must raise EngineDeadError naming the kill, got {box[0]!r}"
        with pytest.raises(EngineDeadError):
            eng.add_request("later", "x", SamplingParams(max_tokens=2))
    finally:
        eng.shutdown()


def test_no_core_process_outlives_shutdown_or_garbage_collection():
    a = make_llm(block_size=16, multiprocess_mode=True)
    pa = a.llm_engine.engine_core.proc.pid
    a.shutdown()
    assert _wait_gone(pa), "the core process outlived shutdown()"
    b = make_llm(block_size=16, multiprocess_mode=True)
    pb = b.llm_engine.engine_core.proc.pid
    del b
    gc.collect()
    assert _wait_gone(pb), "the core process outlived its LLM (nothing stopped it on garbage collection)"


def test_core_process_exits_when_its_front_end_is_killed():
    r = subprocess.run([sys.executable, str(PROGRAMS / "front_end_killed.py")], capture_output=True, text=True,
                       timeout=HANG_GUARD_S)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    core = int(r.stdout.split()[0])
    assert _wait_gone(core), "the core process kept running after its front end was killed (an orphan)"


def test_unknown_utility_is_refused_and_the_core_keeps_serving():
    for mp in (False, True):
        llm = make_llm(block_size=16, multiprocess_mode=mp)
        try:
            with pytest.raises(RuntimeError, match="not a utility method"):
                llm.llm_engine.engine_core.call_utility("shutdown")
            out = llm.generate(["def f():"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 3, "the core stopped serving after a refused utility call"
        finally:
            llm.shutdown()


def test_messages_round_trip_typed_and_without_pickle():
    enc = MsgpackEncoder()
    req = EngineCoreRequest("r", "hi", [1, 2, 3], SamplingParams(n=2, seed=-5, stop=["x"], logit_bias={4: 1.5}),
                            12.5, priority=3, eos_token_id=0, cache_salt="t")
    assert MsgpackDecoder(EngineCoreRequest).decode(enc.encode(req)) == req, "a request changed in transit"
    outs = EngineCoreOutputs([EngineCoreOutput("r", [5], "stop", logprobs=[([5, 6], [-0.1, -2.0], 1)])],
                             first_scheduled=["r"], timestamps={"start": 1.0})
    back = MsgpackDecoder(EngineCoreOutputs).decode(enc.encode(outs))
    assert back.outputs[0].request_id == "r" and back.outputs[0].logprobs == [[[5, 6], [-0.1, -2.0], 1]], (
        f"an engine core output changed in transit (request id or logprobs lost or garbled): {back.outputs[0]!r}")
    for t in (torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.randn(3, 4).to(torch.bfloat16),
              torch.empty(0, 5), torch.tensor(True)):
        got = MsgpackDecoder().decode(enc.encode({"t": t}))["t"]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), f"tensor {t.dtype} garbled"
    with pytest.raises(NotImplementedError, match="cannot send a object"):
        enc.encode(object())
    with pytest.raises(msgspec.ValidationError):  # typed: a wrong field type is refused, not passed on
        MsgpackDecoder(EngineCoreRequest).decode(enc.encode({"request_id": 5}))
