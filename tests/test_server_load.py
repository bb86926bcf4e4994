"""The server under load: 100 concurrent streams with bad requests mixed in, 20
clients that disconnect mid-stream, and SIGTERM while requests are in flight."""
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
PROMPTS = [f"def f{i}(x):\n    return x * {i} + {i % 7}" for i in range(N_STREAMS)]


@pytest.fixture(scope="module")
def server():
    s = Server("--timeout-graceful-shutdown", "3")
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
    gen_before = server.metrics()["vllm:generation_tokens_total"]
    n_clients, max_tokens = 20, 400

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
    m = server.wait_idle(timeout=20)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0, \
        "a disconnected client's request is still in the engine"
    assert m["vllm:kv_cache_usage_perc"] == 0.0, "a disconnected client's blocks were not freed"
    generated = m["vllm:generation_tokens_total"] - gen_before
    assert generated < n_clients * max_tokens / 4, \
        f"{generated} tokens generated: disconnected requests ran on instead of being aborted"
    r = httpx.post(server.url + "/v1/completions", json={"model": SERVED_NAME, "prompt": "x", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200, "server must keep serving after the disconnects"


def test_non_streamed_clients_that_time_out_are_aborted(server):
    gen_before = server.metrics()["vllm:generation_tokens_total"]
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
    m = server.wait_idle(timeout=20)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0, \
        "a non-streamed request whose client left is still running"
    generated = m["vllm:generation_tokens_total"] - gen_before
    assert generated < 4 * max_tokens / 3, f"{generated} tokens: timed-out requests were not aborted"


def test_sigterm_under_load_exits_cleanly(server):
    """Last in this file: it stops the module's server."""
    s = server
    short = {"model": SERVED_NAME, "prompt": "def a():", "max_tokens": 20, "temperature": 0, "stream": True,
             "ignore_eos": True}
    long = dict(short, prompt="def b():", max_tokens=900)
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
            results[name] = e

    async def main():
        tasks = [asyncio.create_task(consume("long", long))]
        await asyncio.sleep(0.5)
        tasks += [asyncio.create_task(consume(f"short{i}", short)) for i in range(4)]
        await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 30)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(s.proc.wait, 30)
        await asyncio.wait(tasks, timeout=10)
        return rc, time.monotonic() - t0

    try:
        rc, took = asyncio.run(main())
    except subprocess.TimeoutExpired:
        s.stop(signal.SIGKILL)
        pytest.fail("server did not exit within 30 s of SIGTERM")
    assert rc == 0, f"SIGTERM must exit with 0, got {rc}: {s.log()}"
    assert took < 15, f"shutdown took {took:.1f} s with a 3 s grace period"
    for i in range(4):
        lines = results.get(f"short{i}")
        assert isinstance(lines, list) and lines[-1] == "data: [DONE]", \
            f"short request {i} in flight at SIGTERM must finish during the grace period: {lines!r}"
    long_lines = results.get("long")
    assert not (isinstance(long_lines, list) and long_lines and long_lines[-1] == "data: [DONE]"
                and len(long_lines) > 900), "a 900-token request cannot have finished within 3 s"
