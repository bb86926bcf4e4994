"""A 2 MB prompt must not freeze the server: a completion with it is refused before
tokenizing (vLLM's bound: more characters than max_model_len tokens can hold),
and a /tokenize of it runs off the event loop, so that meanwhile a running
stream keeps its pace and /health answers at once.

"At once" is measured against a floor taken in the same run, so that it does not
depend on the machine's speed: the stream's largest gap between two events and
/health's slowest answer while nothing big is asked (BASELINE_S), times 3, and
never below the issue's 0.5 s. The stream runs with a step floor
(tests/fault_server.py), so it is still running when the big requests end by
construction (its 1000 tokens take at least 20 s). /tokenize runs in a worker
process of the server's: the last test checks it does not outlive the server.

The stream, the /health prober and the big requests each run in a thread of
their own with a blocking client, so that reading a 6 MB answer here cannot
delay the timestamps of the other two."""
import json
import os
import threading
import time

import httpx
import pytest

from mini_vllm.entrypoints.openai.tokenize_worker import WORKER_NICENESS
from server_utils import SERVED_NAME, Server, child_processes, pid_alive

BIG = ("def f(x):\n    return x * 2 + 1\n" * 70_000)[:2_000_000]  # 2 MB of code, ~900k tokens
STEP_FLOOR_S = 0.02
BASELINE_S = 2.0
LIMIT_S = 0.5


@pytest.fixture(scope="module")
def server():
    s = Server(fault=f"step-floor:{STEP_FLOOR_S}")
    yield s
    s.stop()


class Stream(threading.Thread):
    """One long stream; `times`: when each event arrived."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.times, self.error = url, [], None

    def run(self) -> None:
        body = {"model": SERVED_NAME, "prompt": "def main():", "max_tokens": 1000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                for ln in r.iter_lines():
                    if ln.startswith("data: "):
                        self.times.append(time.monotonic())
        except httpx.HTTPError as e:
            self.error = e


class HealthProbe(threading.Thread):
    """/health every 50 ms; `samples`: (sent at, seconds to answer, status)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.stop = url, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                t0 = time.monotonic()
                code = http.get(self.url + "/health").status_code
                self.samples.append((t0, time.monotonic() - t0, code))
                time.sleep(0.05)


def _max_gap(times, t0, t1) -> float:
    inside = [t for t in times if t0 <= t <= t1]
    before = [t for t in times if t < t0]
    pts = before[-1:] + inside
    gaps = [b - a for a, b in zip(pts, pts[1:])]
    after = [t for t in times if t > t1]  # the gap that spans the window's end counts too
    if pts and after:
        gaps.append(after[0] - pts[-1])
    return max(gaps, default=float("inf"))


def _slowest(samples, t0, t1) -> float:
    return max((d for s, d, _ in samples if t0 <= s <= t1), default=float("inf"))


def test_big_prompt_refused_before_tokenizing_and_big_tokenize_off_the_event_loop(server):
    stream, probe = Stream(server.url), HealthProbe(server.url)
    stream.start()
    for _ in range(600):  # the first token (hang guard: 60 s)
        if stream.times:
            break
        time.sleep(0.1)
    assert stream.times, f"setup: the stream never started: {stream.error!r}"
    probe.start()
    t_base = time.monotonic()
    time.sleep(BASELINE_S)
    t_big = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=120) as http:
        t0 = time.monotonic()
        refused = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": BIG, "max_tokens": 4})
        refuse_s = time.monotonic() - t0
        t0 = time.monotonic()
        tokenized = http.post("/tokenize", json={"model": SERVED_NAME, "prompt": BIG})
        tokenize_s = time.monotonic() - t0
    t_end = time.monotonic()
    time.sleep(0.3)  # one more /health answer and one more stream event after the window
    probe.stop.set()
    probe.join(60)
    still_running = stream.is_alive()
    base_gap, big_gap = _max_gap(stream.times, t_base, t_big), _max_gap(stream.times, t_big, t_end)
    base_health, big_health = _slowest(probe.samples, t_base, t_big), _slowest(probe.samples, t_big, t_end)
    print(f"refused in {refuse_s:.2f} s, /tokenize in {tokenize_s:.2f} s; stream gap {base_gap:.3f} -> "
          f"{big_gap:.3f} s, /health {base_health:.3f} -> {big_health:.3f} s")

    assert refused.status_code == 400, f"a 2 MB prompt must get 400: {refused.status_code} {refused.text[:300]}"
    err = refused.json()["error"]
    assert err["param"] == "prompt" and "2000000 input characters" in err["message"], \
        f"the 400 must name the prompt and its length in characters: {err}"
    assert tokenized.status_code == 200, f"/tokenize of 2 MB failed: {tokenized.status_code} {tokenized.text[:300]}"
    count = json.loads(tokenized.content)["count"]
    assert count > 100_000, f"/tokenize must tokenize the whole text, got {count} tokens"
    assert still_running, "setup: the stream ended before the big requests did; nothing was measured"
    assert all(code == 200 for _, _, code in probe.samples), "/health failed while the big requests ran"
    gap_limit = max(LIMIT_S, 3 * base_gap)
    assert big_gap < gap_limit, (
        f"a running stream stalled {big_gap:.2f} s (limit {gap_limit:.2f} s, 3x its {base_gap:.3f} s baseline) "
        "while a 2 MB prompt was refused and tokenized: tokenization blocks the event loop")
    health_limit = max(LIMIT_S, 3 * base_health)
    assert big_health < health_limit, (
        f"/health took {big_health:.2f} s (limit {health_limit:.2f} s, 3x its {base_health:.3f} s baseline) "
        "while a 2 MB prompt was refused and tokenized: tokenization blocks the event loop")


def test_big_chat_message_refused_before_tokenizing_naming_messages(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": BIG}]})
    assert r.status_code == 400, f"a 2 MB chat message must get 400: {r.status_code} {r.text[:300]}"
    err = r.json()["error"]
    assert err["param"] == "messages" and "characters" in err["message"], \
        f"the 400 must name messages and their length in characters: {err}"


def test_the_tokenize_worker_ends_with_the_server(server):
    """Last in this file: it stops the module's server (the /tokenize above started the worker)."""
    children = list(child_processes(server.proc.pid))
    assert len(children) >= 2, f"setup: expected the engine core and the /tokenize worker under the server: {children}"
    nice = {p: os.getpriority(os.PRIO_PROCESS, p) for p in [server.proc.pid, *children]}
    assert max(nice[p] for p in children) >= nice[server.proc.pid] + WORKER_NICENESS, (
        f"niceness {nice}: the /tokenize worker runs at the server's priority, so a huge count competes "
        "with the streams for the cores")
    rc = server.stop()
    for _ in range(100):  # the worker notices its parent's exit within half a second
        if not any(pid_alive(p) for p in children):
            break
        time.sleep(0.1)
    left = [p for p in children if pid_alive(p)]
    assert rc == 0 and not left, f"processes left after the server exited with {rc}: {left}"
