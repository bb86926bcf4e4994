"""The server under load: 100 concurrent streams with bad requests mixed in, 20
clients that disconnect mid-stream, and SIGTERM while requests are in flight.

Nothing here depends on how fast the engine is. The server steps no faster than
STEP_FLOOR_S a step (tests/fault_server.py), so a request of N output tokens
runs at least N * STEP_FLOOR_S seconds on any machine: the long requests below
(600-900 tokens, 12-18 s at least) are still running when a client leaves or
SIGTERM arrives by construction, and the tests check outcomes (finish reasons,
the end of each stream) rather than how much got done in a time window.
Timeouts are hang guards only."""
import asyncio
import signal
import subprocess
import time

import httpx
import openai
import pytest

from engine_utils import make_llm
from mini_vllm import SamplingParams
from server_utils import SERVED_NAME, Server, wait_running

N_STREAMS, MAX_TOKENS = 100, 8
STEP_FLOOR_S = 0.02
SHORT_TOKENS = 60  # at least 1.2 s: still streaming when SIGTERM follows the long request's first token
GRACE_S = 8  # --timeout-graceful-shutdown: far above the short requests' 60 steps, far below the long one's 900
PROMPTS = [f"def f{i}(x):\n    return x * {i} + {i % 7}" for i in range(N_STREAMS)]


@pytest.fixture(scope="module")
def server():
    s = Server("--timeout-graceful-shutdown", str(GRACE_S), fault=f"step-floor:{STEP_FLOOR_S}")
    yield s
    s.stop()  # a no-op after the SIGTERM test, which runs last


def test_100_concurrent_streams_are_correct_and_free_the_pool(server):
    off = make_llm().generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                              use_tqdm=False)
    gen_before = server.metrics()["vllm:generation_tokens_total"]

    async def stream(client, p):
        text, finish = "", None
        async for ch in await client.completions.create(model=SERVED_NAME, prompt=p, max_tokens=MAX_TOKENS,
                                                        temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True}):
            for c in ch.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, finish

    async def bad(http, i):  # each rejected without touching the streams in flight
        body = [{"prompt": "x", "max_tokens": -1}, {"prompt": "x", "temperature": -2},
                {"prompt": list(range(5, 1100)), "max_tokens": 4}][i % 3]
        return (await http.post("/v1/completions", json={"model": SERVED_NAME, **body})).status_code

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            res = await asyncio.wait_for(asyncio.gather(*(stream(client, p) for p in PROMPTS),
                                                        *(bad(http, i) for i in range(9))), 180)
        await client.close()
        return res

    t0 = time.perf_counter()
    res = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    streams, codes = res[:N_STREAMS], res[N_STREAMS:]
    assert codes == [400] * 9, f"bad requests during load must get 400, got {codes}"
    wrong = [i for i, ((text, fin), o) in enumerate(zip(streams, off)) if text != o.outputs[0].text]
    assert not wrong, f"{len(wrong)} of {N_STREAMS} concurrent streams differ from LLM.generate: {wrong[:5]}"
    assert all(fin == "length" for _, fin in streams)
    m = server.wait_idle()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0, "KV blocks still in use after every stream finished"
    assert m["vllm:generation_tokens_total"] - gen_before == N_STREAMS * MAX_TOKENS, \
        "generation-token counter must count exactly the streamed tokens"
    assert m["vllm:time_to_first_token_seconds_count"] >= N_STREAMS
    assert m["vllm:e2e_request_latency_seconds_count"] >= N_STREAMS
    assert m["vllm:prompt_tokens_total"] > 0 and m["vllm:prefix_cache_queries_total"] > 0
    print(f"{N_STREAMS} streams x {MAX_TOKENS} tokens in {elapsed:.1f} s")


def test_20_clients_disconnecting_mid_stream_leave_nothing_behind(server):
    """900 tokens take at least 18 s here: a request that finishes "length" ran on
    after its client left. (Client aborts are not counted by finish reason, as in
    vLLM, so the check is that none of them reached its end.)"""
    before = server.finished()
    n_clients, max_tokens = 20, 900

    async def drop(i):
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            body = {"model": SERVED_NAME, "prompt": f"class C{i}:\n", "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= 3:
                        return n  # leaving the blocks closes the connection mid-stream

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(drop(i) for i in range(n_clients))), 120)

    got = asyncio.run(main())
    assert got == [3] * n_clients
    m = server.wait_idle(timeout=60)  # a hang guard: aborts take effect within a step or two
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0, \
        "a disconnected client's request is still in the engine"
    assert m["vllm:kv_cache_usage_perc"] == 0.0, "a disconnected client's blocks were not freed"
    ran_on = server.finished().get("length", 0) - before.get("length", 0)
    assert ran_on == 0, f"{ran_on} of {n_clients} disconnected requests ran on to max_tokens instead of being aborted"
    r = httpx.post(server.url + "/v1/completions", json={"model": SERVED_NAME, "prompt": "x", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200, "server must keep serving after the disconnects"


def test_non_streamed_clients_that_give_up_are_aborted(server):
    """Four non-streamed requests of 600 tokens (at least 12 s each here) run; once
    /metrics shows all four in the engine, their clients give up and close the
    connections. The server must notice and abort them: none may reach max_tokens."""
    before = server.finished()
    max_tokens = 600

    async def post(http, path, body):
        await http.post(path, json={"model": SERVED_NAME, "max_tokens": max_tokens, "temperature": 0,
                                    "ignore_eos": True, **body})

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            clients = [asyncio.create_task(post(http, "/v1/completions", {"prompt": f"def g{i}():"}))
                       for i in range(3)]
            clients.append(asyncio.create_task(post(http, "/v1/chat/completions",
                                                    {"messages": [{"role": "user", "content": "x"}]})))
            await wait_running(http, 4)
            for c in clients:
                c.cancel()  # the client gives up: its connection closes
            await asyncio.gather(*clients, return_exceptions=True)

    asyncio.run(main())
    m = server.wait_idle(timeout=60)  # a hang guard
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0, \
        "a non-streamed request whose client left is still running"
    ran_on = server.finished().get("length", 0) - before.get("length", 0)
    assert ran_on == 0, f"{ran_on} of 4 abandoned requests ran on to max_tokens instead of being aborted"


def test_sigterm_under_load_exits_cleanly(server):
    """Last in this file: it stops the module's server.

    The short requests (SHORT_TOKENS steps, at least 1.2 s) start first; the long one
    (900 steps, at least 18 s) starts once they stream, and SIGTERM follows its first
    token. So at SIGTERM every request is in flight (checked below, not assumed); the
    shorts need far less than the grace period and the long one far more, whatever
    the machine's speed, since both are set by the step floor: the shorts must end
    with [DONE] and the long one must be cut when the grace period ends."""
    s = server
    short = {"model": SERVED_NAME, "prompt": "def a():", "max_tokens": SHORT_TOKENS, "temperature": 0,
             "stream": True, "ignore_eos": True}
    long = dict(short, prompt="def b():", max_tokens=900)
    assert long["max_tokens"] * STEP_FLOOR_S > 2 * GRACE_S > 4 * SHORT_TOKENS * STEP_FLOOR_S
    results, started = {}, {}

    async def consume(name, body):
        started[name] = asyncio.Event()
        lines = results[name] = []
        try:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for ln in r.aiter_lines():
                        if ln.startswith("data: "):
                            lines.append(ln)
                            started[name].set()  # in flight: the server has begun streaming it
        except httpx.HTTPError as e:
            results[name] = (lines, e)

    async def main():
        tasks = [asyncio.create_task(consume(f"short{i}", short)) for i in range(4)]
        await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 60)
        tasks.append(asyncio.create_task(consume("long", long)))
        await asyncio.sleep(0)
        await asyncio.wait_for(started["long"].wait(), 60)
        at_signal = {name: len(lines) for name, lines in results.items()}
        s.proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(s.proc.wait, 60)
        await asyncio.wait(tasks, timeout=30)
        return rc, at_signal

    try:
        rc, at_signal = asyncio.run(main())
    except subprocess.TimeoutExpired:
        s.stop(signal.SIGKILL)
        pytest.fail(f"server did not exit within 60 s of SIGTERM (grace period: {GRACE_S} s)")
    assert all(n <= SHORT_TOKENS for n in at_signal.values()), \
        f"the test's premise failed: a request had finished before SIGTERM ({at_signal} data lines)"
    assert rc == 0, f"SIGTERM must exit with 0, got {rc}: {s.log()}"
    for i in range(4):
        lines = results.get(f"short{i}")
        assert isinstance(lines, list) and lines[-1] == "data: [DONE]", \
            f"short request {i} in flight at SIGTERM must finish during the grace period: {lines!r}"
    long_lines = results["long"][0] if isinstance(results["long"], tuple) else results["long"]
    assert isinstance(results["long"], list) and len(long_lines) < 900, \
        f"the long request must be ended when the grace period ends, not cut nor run to its end: {results['long']!r}"
    assert long_lines[-1] == "data: [DONE]" and '"code":503' in long_lines[-2], \
        f"the long request must end with a 503 error event and [DONE] when the grace period ends: {long_lines[-2:]}"
