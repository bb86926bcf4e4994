"""A dead engine ends the server, as vLLM's does: every in-flight request gets an
error that names the cause, /health answers 503, and the process exits with a
non-zero code so that a supervisor restarts it.

The fault is planted by tests/fault_server.py: a step raises when it schedules a
request whose prompt is FAULT_MARKER, so the test chooses the moment the engine
dies; every step lasts at least STEP_FLOOR_S, so the 900-token requests are still
running then (900 steps take at least 45 s, against the few steps the test needs
to see them all in flight and send the marker), not because the engine happens
to be slow."""
import asyncio
import json
import os
import signal
import subprocess

import httpx
import pytest

from engine_utils import SMALL_KV, target_path
from fault_server import FAULT_MARKER, with_fault
from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.engine.exceptions import EngineDeadError
from mini_vllm.entrypoints.openai.api_server import build_app
from mini_vllm.executor.uniproc_executor import UniProcExecutor
from mini_vllm.metrics.prometheus import PrometheusStatLogger
from server_utils import SERVED_NAME, Server, engine_core_pid, leftover_processes, pid_alive, wait_running

STEP_FLOOR_S = 0.05
N_STREAMS, N_WHOLE = 6, 2
LONG = {"model": SERVED_NAME, "max_tokens": 900, "temperature": 0, "ignore_eos": True}


async def _stream(http, i, lines, in_flight):
    async with http.stream("POST", "/v1/completions", json={**LONG, "prompt": f"def f{i}():", "stream": True}) as r:
        assert r.status_code == 200, f"stream {i} refused before the fault: {r.status_code}"
        async for ln in r.aiter_lines():
            if ln.startswith("data: "):
                lines.append(ln[len("data: "):])
                if len(lines) == 2:
                    in_flight.set()


async def _load_then(http, kill):
    """N_STREAMS streams and N_WHOLE whole requests, all seen in flight; then
    `await kill(http)` (its result is returned); then /health probed until the
    server is gone, and every stream read to its end. Returns (stream lines,
    whole responses, kill's result, /health codes)."""
    lines = [[] for _ in range(N_STREAMS)]
    in_flight = [asyncio.Event() for _ in range(N_STREAMS)]
    streams = [asyncio.create_task(_stream(http, i, lines[i], in_flight[i])) for i in range(N_STREAMS)]
    whole = [asyncio.create_task(http.post("/v1/completions", json={**LONG, "prompt": f"x{i} ="}))
             for i in range(N_WHOLE)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in in_flight)), 60)
    await wait_running(http, N_STREAMS + N_WHOLE)
    killed = await kill(http)
    health_after = []
    for _ in range(50):  # until the server is gone (it answers at once while it is up)
        try:
            health_after.append((await http.get("/health")).status_code)
        except httpx.HTTPError:
            break
        await asyncio.sleep(0.05)
    await asyncio.wait_for(asyncio.gather(*streams), 60)
    return lines, [await w for w in whole], killed, health_after


def test_engine_death_under_streaming_load_errors_every_request_and_exits_nonzero():
    s = Server("--timeout-graceful-shutdown", "10", fault=f"raise-on-marker,step-floor:{STEP_FLOOR_S}")
    try:
        async def send_marker(http):
            return await http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": FAULT_MARKER,
                                                            "max_tokens": 2})

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
                return await _load_then(http, send_marker)

        lines, whole, marker, health_after = asyncio.run(main())
        try:
            rc = s.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit within 30 s of its engine dying: a supervisor would never "
                        f"restart it; /health answered {health_after}")
        log = s.log()
    finally:
        s.stop()
    assert rc not in (0, None), f"a server whose engine died must exit non-zero, got {rc}"
    assert "PlantedFault" in log and "engine died" in log, f"the log must name the exception: {log[-1500:]}"
    assert 200 not in health_after, f"/health answered 200 after the engine died: {health_after}"
    for r in [marker, *whole]:
        assert r.status_code == 503, f"an in-flight request must get 503 when the engine dies: {r.status_code}"
        assert "PlantedFault" in r.json()["error"]["message"], f"the error must name the cause: {r.text[:300]}"
    for i, got in enumerate(lines):
        assert got[-1] == "[DONE]", f"stream {i} was cut instead of ending with an error event: {got[-3:]}"
        err = json.loads(got[-2]).get("error")
        assert err is not None and err["code"] == 503 and "PlantedFault" in err["message"], \
            f"stream {i} must end with an error event naming the cause: {got[-2][:300]}"
        assert len(got) < 900, f"stream {i} ran to its end although the engine died"


def test_health_is_503_and_requests_fail_once_the_engine_died(monkeypatch):
    """The same death with the core in a thread of this process (so that the fault
    can be planted here), through the app without uvicorn: nothing races the
    process exit here, so /health's 503 and the error of a later request are checked
    deterministically, and on_dead (the server's exit) runs exactly once."""
    monkeypatch.setattr(UniProcExecutor, "execute_model", with_fault("raise-on-marker", UniProcExecutor.execute_model))

    async def main():
        deaths = []
        llm = AsyncLLM.from_engine_args(target_path(), on_dead=deaths.append, dtype="float32", device="cpu",
                                        kv_cache_memory_bytes=SMALL_KV, block_size=16)
        app = build_app(llm, [SERVED_NAME], target_path(), PrometheusStatLogger(SERVED_NAME))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
                before = (await http.get("/health")).status_code
                ok = await http.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 2})
                dying = await http.post("/v1/completions", json={"prompt": FAULT_MARKER, "max_tokens": 2})
                after = (await http.get("/health")).status_code
                later = await http.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 2})
            return deaths, before, ok, dying, after, later
        finally:
            llm.shutdown()

    deaths, before, ok, dying, after, later = asyncio.run(main())
    assert before == 200 and ok.status_code == 200, f"the engine must serve before the fault: {ok.text[:200]}"
    assert dying.status_code == 503 and "PlantedFault" in dying.json()["error"]["message"], dying.text[:300]
    assert after == 503, f"/health must answer 503 once the engine died, got {after}"
    assert later.status_code == 503 and "engine died" in later.json()["error"]["message"], \
        f"a request after the death must get 503 naming it, not hang or 500: {later.text[:300]}"
    assert len(deaths) == 1 and isinstance(deaths[0], EngineDeadError) and "PlantedFault" in str(deaths[0]), \
        f"on_dead (the server's exit) must run once, with an error naming the core's exception: {deaths}"


def test_core_process_killed_under_streaming_load_ends_every_request_and_the_server():
    """Chaos: SIGKILL the engine core process (no DEAD message, no cleanup) while
    streams run. The front end must notice the process exit, end every request
    with a 503 / an error event, answer /health with 503, exit non-zero, and leave
    no process behind (the resource tracker and the core are gone)."""
    s = Server("--timeout-graceful-shutdown", "10", fault=f"step-floor:{STEP_FLOOR_S}")
    try:
        core = engine_core_pid(s.proc.pid)

        async def kill_core(http):
            os.kill(core, signal.SIGKILL)

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
                return await _load_then(http, kill_core)

        lines, whole, _, health_after = asyncio.run(main())
        try:
            rc = s.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within 30 s of its core being killed; /health: {health_after}")
        children = leftover_processes(s.proc.pid, core, tries=100)
        log = s.log()
    finally:
        s.stop()
    assert rc not in (0, None), f"a server whose core was killed must exit non-zero, got {rc}"
    assert not pid_alive(core), "the killed core process is still there"
    assert not children, f"processes left behind by the server: {children}"
    assert "exited with status -9" in log, f"the log must say the core process was killed: {log[-1500:]}"
    # The kill is noticed by a monitor thread, so the first probe may still race it;
    # once /health has said 503 it must never say 200 again.
    bad = next((i for i, h in enumerate(health_after) if h != 200), len(health_after))
    assert 200 not in health_after[bad:], f"/health answered 200 again after the core died: {health_after}"
    for r in whole:
        assert r.status_code == 503 and "exited with status -9" in r.json()["error"]["message"], \
            f"an in-flight request must get 503 naming the core's exit: {r.status_code} {r.text[:300]}"
    for i, got in enumerate(lines):
        assert got[-1] == "[DONE]", f"stream {i} was cut instead of ending with an error event: {got[-3:]}"
        err = json.loads(got[-2]).get("error")
        assert err is not None and err["code"] == 503, f"stream {i} must end with a 503 error event: {got[-2][:300]}"
        assert len(got) < 900, f"stream {i} ran to its end although the core was killed"
