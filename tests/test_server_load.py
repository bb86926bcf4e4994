"""The server under load: 100 concurrent streams with bad requests mixed in, 20
clients that disconnect mid-stream, and SIGTERM while requests are in flight.

Nothing here depends on how fast the engine is. The server steps no faster than
STEP_FLOOR_S a step (tests/fault_server.py), so a request of N output tokens
runs at least N * STEP_FLOOR_S seconds on any machine: the long requests below
(400-900 tokens, 8-18 s at least) are still running when a client leaves or
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
from server_utils import SERVED_NAME, Server

N_STREAMS, MAX_TOKENS = 100, 8
STEP_FLOOR_S = 0.02
GRACE_S = 8  # --timeout-graceful-shutdown: far above the short requests' 20 steps
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


def test_non_streamed_clients_that_time_out_are_aborted(server):
    """600 tokens take at least 12 s here, so the clients' 0.5 s timeout always fires
    first; the server must notice the closed connections and abort."""
    before = server.finished()
    max_tokens = 600

    async def give_up(i, path, body):
        async with httpx.AsyncClient(base_url=server.url, timeout=0.5) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(path, json={"model": SERVED_NAME, "max_tokens": max_tokens, "temperature": 0,
                                            "ignore_eos": True, **body})

    async def main():
        await asyncio.gather(*(give_up(i, "/v1/completions", {"prompt": f"def g{i}():"}) for i in range(3)),
                             give_up(9, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}))

    asyncio.run(main())
    m = server.wait_idle(timeout=60)  # a hang guard
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0, \
        "a non-streamed request whose client left is still running"
    ran_on = server.finished().get("length", 0) - before.get("length", 0)
    assert ran_on == 0, f"{ran_on} of 4 timed-out requests ran on to max_tokens instead of being aborted"


def test_sigterm_under_load_exits_cleanly(server):
    """Last in this file: it stops the module's server. The long request needs at
    least 900 * STEP_FLOOR_S = 18 s, more than the grace period: it is in flight when
    the grace period ends, by construction, and must be cut then (the process
    must not wait for it); the short ones (20 steps) must finish within it."""
    s = server
    short = {"model": SERVED_NAME, "prompt": "def a():", "max_tokens": 20, "temperature": 0, "stream": True,
             "ignore_eos": True}
    long = dict(short, prompt="def b():", max_tokens=900)
    assert long["max_tokens"] * STEP_FLOOR_S > 2 * GRACE_S
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
        tasks = [asyncio.create_task(consume("long", long))]
        tasks += [asyncio.create_task(consume(f"short{i}", short)) for i in range(4)]
        await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 60)
        s.proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(s.proc.wait, 60)
        await asyncio.wait(tasks, timeout=30)
        return rc

    try:
        rc = asyncio.run(main())
    except subprocess.TimeoutExpired:
        s.stop(signal.SIGKILL)
        pytest.fail("server did not exit within 60 s of SIGTERM (grace period: 8 s)")
    assert rc == 0, f"SIGTERM must exit with 0, got {rc}: {s.log()}"
    for i in range(4):
        lines = results.get(f"short{i}")
        assert isinstance(lines, list) and lines[-1] == "data: [DONE]", \
            f"short request {i} in flight at SIGTERM must finish during the grace period: {lines!r}"
    long_lines = results["long"][0] if isinstance(results["long"], tuple) else results["long"]
    assert long_lines and long_lines[-1] != "data: [DONE]" and len(long_lines) < 900, \
        "the long request must be cut when the grace period ends; the server waited for it instead"
