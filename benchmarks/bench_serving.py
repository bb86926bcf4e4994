"""Online serving benchmark: Poisson arrivals against `python -m mini_vllm serve`.

vLLM counterpart: `vllm bench serve` (`vllm/benchmarks/serve.py`). The server
runs the tiny target on CPU in a subprocess (or pass --base-url for one that
is already running). Workload: `--num-requests` prompts cut from the standard
library (`engine_workloads.sample_requests`), streamed /v1/completions with
temperature 0 and ignore_eos, so every request produces exactly its
`max_tokens`.

For each request rate (requests/s; "inf" sends all at once) the requests
arrive as a Poisson process (exponential gaps, fixed seed). Then the same
requests are sent one at a time, each after the previous one finished: what
a server without batching would do; that run is repeated after the batched
ones and the mean of both is the baseline (the load of a shared machine
drifts). Reported per run: TTFT, inter-token
latency (gap between streamed chunks) and end-to-end latency at
p50/p90/p99, request and output-token throughput, and the ratio of token
throughput to the one-at-a-time run. Goal: >= 4x at the highest rate.

Run: .venv/bin/python benchmarks/bench_serving.py [--rates 2 8 32] [--num-requests 48]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx

from engine_workloads import sample_requests
from mini_vllm.metrics import percentile
from mini_vllm.tiny_models import model_path

GOAL = 4.0


def start_server(threads: int, kv_bytes: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "mini_vllm", "serve", str(model_path("tiny-py-target")),
                             "--port", str(port), "--device", "cpu", "--served-model-name", "tiny",
                             "--kv-cache-memory-bytes", str(kv_bytes), "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise RuntimeError("server did not become healthy in 180 s")


async def one_request(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, n_out = [], 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                times.append(time.perf_counter())
            if chunk.get("usage"):
                n_out = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if n_out != max_tokens:
        raise RuntimeError(f"expected {max_tokens} tokens, got {n_out}")
    return {"ttft": times[0] - t0, "itls": [b - a for a, b in zip(times, times[1:])], "e2e": end - t0,
            "n_out": n_out}


async def run_rate(url: str, reqs, rate: float | None, seed: int) -> tuple[list[dict], float]:
    """rate None: one request at a time; inf: all at once; else Poisson arrivals."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(reqs) + 4, max_keepalive_connections=len(reqs) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        if rate is None:
            results = [await one_request(http, p, m) for p, m in reqs]
        else:
            tasks = []
            for p, m in reqs:
                tasks.append(asyncio.create_task(one_request(http, p, m)))
                if rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(rate))
            results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(name: str, results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itls"]]
    e2e = [r["e2e"] for r in results]
    out = sum(r["n_out"] for r in results)
    row = {"run": name, "req_per_s": len(results) / wall, "tok_per_s": out / wall, "wall_s": wall}
    for key, xs in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            row[f"{key}_p{q}_ms"] = 1000 * percentile(xs, q)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 32.0])
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 96])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    ap.add_argument("--base-url", default=None, help="use a running server (model name 'tiny')")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reqs = sample_requests(args.num_requests, tuple(args.input_len), tuple(args.output_len), seed=args.seed)
    proc, url = (None, args.base_url) if args.base_url else start_server(args.threads, args.kv_cache_memory_bytes)
    try:
        asyncio.run(run_rate(url, reqs[:2], None, 0))  # warm-up
        rows = [summarize("one at a time", *asyncio.run(run_rate(url, reqs, None, args.seed)))]
        for rate in sorted(args.rates):
            rows.append(summarize(f"rate {rate:g}/s", *asyncio.run(run_rate(url, reqs, rate, args.seed))))
        # The sequential run again, last: on a shared machine the load drifts, and the
        # mean of a run before and after the batched ones is a fairer baseline.
        rows.append(summarize("one at a time", *asyncio.run(run_rate(url, reqs, None, args.seed))))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    base = (rows[0]["tok_per_s"] + rows[-1]["tok_per_s"]) / 2
    print(f"\n{args.num_requests} requests, prompts {args.input_len[0]}-{args.input_len[1]} tokens, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, tiny target on CPU, server threads={args.threads}")
    head = (f"{'run':>16} {'req/s':>6} {'tok/s':>7} {'x seq':>6} | {'TTFT p50/p90/p99 ms':>22} | "
            f"{'ITL p50/p90/p99 ms':>20} | {'E2E p50/p90/p99 ms':>22}")
    print(f"(x seq: token throughput over the mean of the two one-at-a-time runs, {base:.1f} tok/s)")
    print(head)
    print("-" * len(head))
    for r in rows:
        def trio(k):
            return "/".join(f"{r[f'{k}_p{q}_ms']:.0f}" for q in (50, 90, 99))
        print(f"{r['run']:>16} {r['req_per_s']:6.2f} {r['tok_per_s']:7.1f} {r['tok_per_s'] / base:6.2f} | "
              f"{trio('ttft'):>22} | {trio('itl'):>20} | {trio('e2e'):>22}")
    ratio = rows[-2]["tok_per_s"] / base
    print(f"\ncontinuous batching / one at a time, token throughput at the highest rate: {ratio:.2f}x "
          f"(goal >= {GOAL:g}x): {'PASS' if ratio >= GOAL else 'MISS'}")
    print("TTFT p99 vs request rate: " + ", ".join(f"{r['run']}: {r['ttft_p99_ms']:.0f} ms" for r in rows[1:-1]))


if __name__ == "__main__":
    main()
