"""SIGTERM answers every request in flight: one that finishes within the grace
period (--timeout-graceful-shutdown) gets its answer; one still running then gets
a 503 in OpenAI's error shape, or in a stream an error event and `data: [DONE]`,
never uvicorn's plain-text 500 or a stream cut mid-body; the process exits with 0
and its log holds no traceback.

Every step lasts at least STEP_FLOOR_S (tests/fault_server.py), so the 900-token
requests cannot finish within GRACE_S (they need at least 18 s) by construction;
the short request needs SHORT_TOKENS steps, a small fraction of GRACE_S."""
import asyncio
import json
import signal
import subprocess
import time

import httpx
import pytest

from server_utils import SERVED_NAME, Server, wait_running

STEP_FLOOR_S = 0.02
GRACE_S = 3.0
SHORT_TOKENS = 8
LONG = {"model": SERVED_NAME, "max_tokens": 900, "temperature": 0, "ignore_eos": True}


async def _stream(http, i, lines):
    async with http.stream("POST", "/v1/completions", json={**LONG, "prompt": f"def f{i}():", "stream": True}) as r:
        assert r.status_code == 200, f"stream {i} refused before the signal: {r.status_code}"
        async for ln in r.aiter_lines():
            if ln.startswith("data: "):
                lines.append(ln[len("data: "):])


def test_sigterm_answers_every_request_in_flight_and_exits_0_without_traceback():
    s = Server("--timeout-graceful-shutdown", str(GRACE_S), fault=f"step-floor:{STEP_FLOOR_S}")
    try:
        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
                lines = [[] for _ in range(3)]
                streams = [asyncio.create_task(_stream(http, i, lines[i])) for i in range(3)]
                whole = [asyncio.create_task(http.post("/v1/completions", json={**LONG, "prompt": f"x{i} ="}))
                         for i in range(2)]
                await wait_running(http, 5)
                short = asyncio.create_task(http.post("/v1/completions", json={
                    "model": SERVED_NAME, "prompt": "y =", "max_tokens": SHORT_TOKENS, "ignore_eos": True}))
                await asyncio.sleep(0.05)  # the short one is in, not finished
                s.proc.send_signal(signal.SIGTERM)
                t_sig = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*streams, *whole, short), 60)
                return lines, results[3:5], results[5], time.monotonic() - t_sig

        lines, whole, short, answered_s = asyncio.run(main())
        try:
            rc = s.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit within 30 s of SIGTERM")
        log = s.log()
    finally:
        s.stop()
    assert rc == 0, f"a server stopped by SIGTERM must exit 0, got {rc}: {log[-1500:]}"
    assert short.status_code == 200 and len(short.json()["choices"][0]["text"]) > 0, (
        f"a request that finishes within the grace period must get its answer: {short.status_code} {short.text[:300]}")
    for r in whole:
        assert r.status_code == 503, f"a request still running after the grace period must get 503, got " \
                                     f"{r.status_code} {r.headers.get('content-type')}: {r.text[:300]}"
        err = r.json()["error"]
        assert err["code"] == 503 and "shutting down" in err["message"], f"not OpenAI's error shape: {err}"
    for i, got in enumerate(lines):
        assert got and got[-1] == "[DONE]", f"stream {i} was cut at shutdown instead of ending with [DONE]: {got[-2:]}"
        err = json.loads(got[-2]).get("error")
        assert err is not None and err["code"] == 503 and "shutting down" in err["message"], \
            f"stream {i} must end with a 503 error event before [DONE]: {got[-2][:300]}"
    assert answered_s < GRACE_S + 10, f"requests answered {answered_s:.1f} s after SIGTERM (grace {GRACE_S} s)"
    assert "Traceback" not in log and "Cancel" not in log, f"the shutdown logged a traceback: {log[-2500:]}"
