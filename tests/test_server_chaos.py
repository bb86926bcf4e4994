"""Chaos: the engine core SIGKILLed at a random instant under streaming load, while
new requests and client disconnects keep arriving, also within the first 50 ms
after the kill. Every run must end with every client answered, the server gone
with a non-zero status within EXIT_LIMIT_S of the kill, and nothing left behind
(no process, no ZeroMQ socket file).

An answer is: a stream that ends with `data: [DONE]` (after its last token, or
after an error event with code 503), a 503 in OpenAI's error shape, a whole
200 response, or a refused connection (the server no longer listens: the OS
answers at once). A client that is still waiting after CLIENT_GUARD_S, a stream
cut without [DONE], or any other status is a failure.

`make test` runs RUNS (3) kills, each at a fresh random instant (the seed is in
the failure message). The long loop is the same test with more runs:
    MINI_VLLM_CHAOS_RUNS=50 MINI_VLLM_CHAOS_REPORT=/tmp/chaos.jsonl \
        .venv/bin/python -m pytest -q tests/test_server_chaos.py
(one JSON line per run in the report file: timings and counts).

Every step lasts at least STEP_FLOOR_S (tests/fault_server.py), so the base
streams (900 tokens) are still running at the kill by construction, whatever
the machine's speed; no assertion depends on speed except the exit limit that
the issue states (10 s)."""
import asyncio
import json
import os
import random
import signal
import subprocess
import time

import httpx
import pytest

from server_utils import SERVED_NAME, Server, engine_core_pid, leftover_processes, pid_alive

RUNS = int(os.environ.get("MINI_VLLM_CHAOS_RUNS", "3"))
SEED = int(os.environ.get("MINI_VLLM_CHAOS_SEED", str(random.SystemRandom().randrange(1 << 30))))
REPORT = os.environ.get("MINI_VLLM_CHAOS_REPORT")
STEP_FLOOR_S = 0.02
EXIT_LIMIT_S = 10.0
CLIENT_GUARD_S = 30.0
N_BASE_STREAMS = 6
BURST_MS = (0, 5, 15, 30, 45)  # new requests and disconnects this long after the kill
MAX_ARRIVALS = 150


class Clients:
    """Starts the clients and records how each one ended."""

    def __init__(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        self.http, self.rng = http, rng
        self.tasks: list[asyncio.Task] = []
        self.results: list[dict] = []

    def start(self, kind: str, max_tokens: int, cut_after: float | None = None) -> asyncio.Task:
        rec = {"kind": kind, "max_tokens": max_tokens, "cut_after": cut_after, "outcome": None, "t_sent": time.monotonic()}
        self.results.append(rec)
        coro = self._stream(rec) if kind == "stream" else self._whole(rec)
        task = asyncio.create_task(coro)
        self.tasks.append(task)
        return task

    def _body(self, rec, stream: bool) -> dict:
        return {"model": SERVED_NAME, "prompt": f"def f{len(self.results)}():", "max_tokens": rec["max_tokens"],
                "temperature": 0, "ignore_eos": True, "stream": stream}

    async def _stream(self, rec) -> None:
        lines: list[str] = []
        rec["lines"] = lines
        try:
            async with self.http.stream("POST", "/v1/completions", json=self._body(rec, True)) as r:
                rec["status"], rec["t_status"] = r.status_code, time.monotonic()
                if r.status_code != 200:
                    rec["body"] = (await r.aread()).decode(errors="replace")
                    return
                reading = self._read_lines(r, lines)
                if rec["cut_after"] is None:
                    await reading
                else:  # the client goes away: the connection closes with the response unread
                    try:
                        await asyncio.wait_for(reading, rec["cut_after"])
                    except asyncio.TimeoutError:
                        rec["outcome"] = "disconnected"
        except asyncio.CancelledError:
            rec["outcome"] = "disconnected"  # cut by the test (a disconnect of a base stream)
        except httpx.HTTPError as e:
            rec["error"] = f"{type(e).__name__}: {e}"

    @staticmethod
    async def _read_lines(r, lines) -> None:
        async for ln in r.aiter_lines():
            if ln.startswith("data: "):
                lines.append(ln[len("data: "):])

    async def _whole(self, rec) -> None:
        try:
            r = await self.http.post("/v1/completions", json=self._body(rec, False))
            rec["status"], rec["body"], rec["t_status"] = r.status_code, r.text, time.monotonic()
        except httpx.HTTPError as e:
            rec["error"] = f"{type(e).__name__}: {e}"


def judge(rec: dict) -> str | None:
    """None if the client was answered; else what went wrong."""
    if rec["outcome"] == "disconnected":
        return None
    err = rec.get("error")
    if err is not None:
        # Nothing listens any more: refused at once by the OS, which is an answer.
        return None if err.startswith("ConnectError") and "status" not in rec else f"transport error: {err}"
    status = rec.get("status")
    if status == 503 or (status == 200 and rec["kind"] == "whole"):
        try:
            body = json.loads(rec["body"])
        except (json.JSONDecodeError, KeyError):
            return f"status {status} with a body that is not JSON: {rec.get('body', '')[:200]!r}"
        if status == 503:
            return None if body.get("error", {}).get("code") == 503 else f"503 not in OpenAI's error shape: {body}"
        return None if body.get("choices") else f"200 without choices: {body}"
    if status == 200:  # a stream
        lines = rec["lines"]
        if not lines or lines[-1] != "[DONE]":
            return f"stream cut without [DONE] after {len(lines)} events: {lines[-2:]}"
        last = json.loads(lines[-2]) if len(lines) >= 2 else {}
        if "error" in last:
            return None if last["error"].get("code") == 503 else f"stream ended with a non-503 error: {last}"
        finished = last.get("choices") and last["choices"][0].get("finish_reason") is not None
        return None if finished else f"stream ended with [DONE] but neither an error nor a finish: {lines[-3:]}"
    return f"status {status}: {rec.get('body', '')[:300]!r}"


async def _drive(s: Server, core: int, rng: random.Random) -> dict:
    limits = httpx.Limits(max_keepalive_connections=0)  # one connection per request: no stale keep-alive reuse
    async with httpx.AsyncClient(base_url=s.url, timeout=CLIENT_GUARD_S, limits=limits) as http:
        c = Clients(http, rng)
        base = [c.start("stream", 900) for _ in range(N_BASE_STREAMS)]
        c.start("whole", 900)
        for _ in range(600):  # until every base stream has its first token (hang guard: 60 s)
            if all(len(r.get("lines", ())) >= 1 for r in c.results[:N_BASE_STREAMS]):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"the base streams never started: {[judge(r) for r in c.results]}")
        stop_arrivals = asyncio.Event()

        async def arrivals():
            while not stop_arrivals.is_set() and len(c.results) < MAX_ARRIVALS:
                pick = rng.random()
                if pick < 0.4:
                    c.start("stream", rng.randint(4, 60))
                elif pick < 0.7:
                    c.start("whole", rng.randint(4, 30))
                else:
                    c.start("stream", rng.randint(20, 200), cut_after=rng.uniform(0.0, 0.15))
                await asyncio.sleep(rng.uniform(0.005, 0.04))

        arriving = asyncio.create_task(arrivals())
        await asyncio.sleep(rng.uniform(0.0, 1.0))  # the random instant
        os.kill(core, signal.SIGKILL)
        t_kill = time.monotonic()
        cut = iter(rng.sample(base, len(BURST_MS)))
        for ms in BURST_MS:
            await asyncio.sleep(max(0.0, t_kill + ms / 1000 - time.monotonic()))
            c.start("stream", 50)
            c.start("whole", 20)
            next(cut).cancel()  # a client disconnects
        await asyncio.sleep(max(0.0, t_kill + 0.3 - time.monotonic()))
        stop_arrivals.set()
        await arriving
        done, pending = await asyncio.wait(c.tasks, timeout=CLIENT_GUARD_S)
        for t in pending:
            t.cancel()
        for t, r in zip(c.tasks, c.results):  # not answered within the guard: the client still waits
            if t in pending and r["outcome"] != "disconnected":
                r["error"] = f"hung: still waiting after {CLIENT_GUARD_S} s (status {r.get('status')})"
        return {"t_kill": t_kill, "results": c.results}


@pytest.mark.parametrize("run", range(RUNS))
def test_core_killed_at_random_instant_every_client_answered_and_nothing_left(run, socket_dir):
    seed = SEED + run
    rng = random.Random(seed)
    sock_dir = socket_dir
    s = Server("--timeout-graceful-shutdown", "10", fault=f"step-floor:{STEP_FLOOR_S}",
               env={"TMPDIR": str(sock_dir)})
    try:
        core = engine_core_pid(s.proc.pid)
        out = asyncio.run(_drive(s, core, rng))
        t_kill = out["t_kill"]
        try:
            rc = s.proc.wait(max(0.1, t_kill + EXIT_LIMIT_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        exit_s = time.monotonic() - t_kill
        children = leftover_processes(s.proc.pid, core, tries=50)
        log = s.log()
    finally:
        s.stop(timeout=5)
    results = out["results"]
    bad = [(i, r["kind"], why) for i, r in enumerate(results) if (why := judge(r)) is not None]
    files = sorted(p.name for p in sock_dir.iterdir())
    counts = {k: sum(1 for r in results if (r.get("status"), r["outcome"], "error" in r) == k)
              for k in {(r.get("status"), r["outcome"], "error" in r) for r in results}}
    first_503 = min((r["t_status"] - t_kill for r in results if r.get("status") == 503), default=None)
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"seed": seed, "rc": rc, "exit_after_kill_s": round(exit_s, 3),
                                "first_503_after_kill_s": None if first_503 is None else round(first_503, 3),
                                "clients": len(results), "unanswered": len(bad),
                                "outcomes": {str(k): v for k, v in counts.items()}, "socket_files": files}) + "\n")
    where = f"(seed {seed}; replay with MINI_VLLM_CHAOS_SEED={seed - run} MINI_VLLM_CHAOS_RUNS={run + 1})"
    assert not bad, f"clients not answered after the core was killed {where}: {bad[:8]}; log: {log[-1500:]}"
    assert rc is not None, f"the server still runs {EXIT_LIMIT_S} s after its core was killed {where}: {log[-1500:]}"
    assert rc != 0, f"a server whose core was killed must exit non-zero, got {rc} {where}"
    assert not pid_alive(core), f"the killed core is still there {where}"
    assert not children, f"processes left behind by the server {where}: {children}"
    assert not files, f"ZeroMQ socket files left in the temp folder after the server exited {where}: {files}"
