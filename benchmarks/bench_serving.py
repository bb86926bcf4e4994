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

Side by side with real vLLM (after `make vllm`; `--servers mini` leaves it out):
`vllm serve` on the same checkpoint with equal settings (fp32, block size 32,
the same KV-cache bytes and max_num_seqs), each server pinned to the same
cores (`--threads`), one after the other. Both are driven by this script's
client (every streamed text must be identical across the two servers before a
ratio is printed) and by vLLM's own client, `vllm bench serve` (random dataset,
`--ignore-eos`; its summary per server and rate, and the ratio of output
throughputs). vLLM's client runs unchanged against `python -m mini_vllm serve`.

Run: .venv/bin/python benchmarks/bench_serving.py [--rates 2 8 32] [--num-requests 48]
     [--threads 1] [--servers mini,vllm] [--vllm-bench-rates 4 16 inf] [--mini-async-scheduling]
     [--mini-flags=-O1]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from engine_workloads import sample_requests
from machine import machine_line
from mini_vllm.metrics.stats import percentile
from mini_vllm.course.tiny_models import model_path
from vllm_side import MISSING, _env, cpu_list, vllm_python

GOAL = 4.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(threads: int, kv_bytes: int, which: str = "mini", max_num_seqs: int = 128,
                 log=None, mini_flags: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`python -m mini_vllm serve` or `vllm serve` on the tiny target, pinned to the first
    `threads` cores, with equal settings; returns (process, base URL) once /health answers."""
    port, cores = free_port(), cpu_list(threads)
    model = str(model_path("tiny-py-target"))
    common = ["--port", str(port), "--served-model-name", "tiny", "--block-size", "32",
              "--kv-cache-memory-bytes", str(kv_bytes), "--max-num-seqs", str(max_num_seqs)]
    if which == "mini":
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "mini_vllm", "serve", model, "--device", "cpu", "--log-level", "warning",
               "--dtype", "float32", *common, *mini_flags]
    else:
        env = dict(_env(threads, in_process=False), VLLM_CPU_OMP_THREADS_BIND=cores)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        cmd = [str(vllm_python().parent / "vllm"), "serve", model, "--host", "127.0.0.1", "--dtype", "float32",
               "--generation-config", "vllm", "--uvicorn-log-level", "warning", *common]
    # The whole server (HTTP front end, engine, its threads) on the same cores for both.
    pin = [int(c) for c in cores.split(",")]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, preexec_fn=lambda: os.sched_setaffinity(0, pin))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # vLLM compiles its model at start-up
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{which} server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise RuntimeError(f"{which} server did not become healthy in 600 s")


async def one_request(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, n_out, text = [], 0, []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                times.append(time.perf_counter())
                text.append(chunk["choices"][0].get("text", ""))
            if chunk.get("usage"):
                n_out = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if n_out != max_tokens:
        raise RuntimeError(f"expected {max_tokens} tokens, got {n_out}")
    return {"ttft": times[0] - t0, "itls": [b - a for a, b in zip(times, times[1:])], "e2e": end - t0,
            "n_out": n_out, "text": "".join(text)}


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


def client_runs(url: str, reqs, rates, seed: int) -> tuple[list[dict], list[str]]:
    """This script's client: one-at-a-time, each rate, one-at-a-time again. Returns the
    summary rows and the texts of the first run (for the identity check across servers)."""
    asyncio.run(run_rate(url, reqs[:2], None, 0))  # warm-up
    first, wall = asyncio.run(run_rate(url, reqs, None, seed))
    rows = [summarize("one at a time", first, wall)]
    for rate in sorted(rates):
        rows.append(summarize(f"rate {rate:g}/s", *asyncio.run(run_rate(url, reqs, rate, seed))))
    # The sequential run again, last: on a shared machine the load drifts, and the
    # mean of a run before and after the batched ones is a fairer baseline.
    rows.append(summarize("one at a time", *asyncio.run(run_rate(url, reqs, None, seed))))
    return rows, [r["text"] for r in first]


def print_rows(title: str, rows: list[dict]) -> None:
    base = (rows[0]["tok_per_s"] + rows[-1]["tok_per_s"]) / 2
    print(f"\n{title} (x seq: token throughput over the mean of the two one-at-a-time runs, {base:.1f} tok/s)")
    head = (f"{'run':>16} {'req/s':>6} {'tok/s':>7} {'x seq':>6} | {'TTFT p50/p90/p99 ms':>22} | "
            f"{'ITL p50/p90/p99 ms':>20} | {'E2E p50/p90/p99 ms':>22}")
    print(head)
    print("-" * len(head))
    for r in rows:
        def trio(k):
            return "/".join(f"{r[f'{k}_p{q}_ms']:.0f}" for q in (50, 90, 99))
        print(f"{r['run']:>16} {r['req_per_s']:6.2f} {r['tok_per_s']:7.1f} {r['tok_per_s'] / base:6.2f} | "
              f"{trio('ttft'):>22} | {trio('itl'):>20} | {trio('e2e'):>22}")
    ratio = rows[-2]["tok_per_s"] / base
    print(f"continuous batching / one at a time, token throughput at the highest rate: {ratio:.2f}x "
          f"(goal >= {GOAL:g}x): {'PASS' if ratio >= GOAL else 'MISS'}")


def vllm_bench_serve(url: str, rate: str, args, out_dir: str) -> dict:
    """vLLM's own client against a server; returns the fields of its saved result."""
    name = f"bench-{abs(hash((url, rate)))}.json"
    cmd = [str(vllm_python().parent / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--model", "tiny", "--tokenizer", str(model_path("tiny-py-target")), "--dataset-name", "random",
           "--random-input-len", str(args.vllm_bench_input_len), "--random-output-len",
           str(args.vllm_bench_output_len), "--num-prompts", str(args.vllm_bench_num_prompts),
           "--request-rate", rate, "--ignore-eos", "--seed", str(args.seed), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", out_dir, "--result-filename", name]
    proc = subprocess.run(cmd, env=_env(1, in_process=False), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n" + proc.stdout[-3000:] + proc.stderr[-3000:])
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


def print_vllm_bench(results: dict) -> None:
    print("\n`vllm bench serve` (random dataset, --ignore-eos): output tok/s | TTFT p50/p99 ms | "
          f"TPOT p50/p99 ms | completed")
    for (server, rate), r in results.items():
        print(f"  {server:<10} rate {rate:>4}: {r['output_throughput']:8.1f} | {r['median_ttft_ms']:6.0f}/"
              f"{r['p99_ttft_ms']:6.0f} | {r['median_tpot_ms']:5.1f}/{r['p99_tpot_ms']:5.1f} | "
              f"{r['completed']}/{r['num_prompts']}")
    rates = sorted({rate for _, rate in results}, key=float)
    if all(("vllm", r) in results and ("mini", r) in results for r in rates):
        print("  mini-vLLM / vLLM output throughput: " + ", ".join(
            f"{results['mini', r]['output_throughput'] / results['vllm', r]['output_throughput']:.2f}x at {r}/s"
            for r in rates))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 32.0])
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 96])
    ap.add_argument("--threads", type=int, default=1, help="cores each server is pinned to")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    ap.add_argument("--servers", default="mini,vllm", help="mini, vllm or both (vllm needs `make vllm`)")
    ap.add_argument("--mini-async-scheduling", action="store_true",
                    help="run the course's server with --async-scheduling (vLLM schedules asynchronously by default)")
    ap.add_argument("--mini-flags", default="",
                    help="more `mini_vllm serve` flags, as one string (e.g. --mini-flags=-O1 for the compiled model)")
    ap.add_argument("--vllm-bench-rates", nargs="*", default=["4", "16", "inf"],
                    help="rates for `vllm bench serve` (none: skip it)")
    ap.add_argument("--vllm-bench-num-prompts", type=int, default=100)
    ap.add_argument("--vllm-bench-input-len", type=int, default=256)
    ap.add_argument("--vllm-bench-output-len", type=int, default=128)
    ap.add_argument("--base-url", default=None, help="use a running server (model name 'tiny'); no vLLM")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reqs = sample_requests(args.num_requests, tuple(args.input_len), tuple(args.output_len), seed=args.seed)
    servers = args.servers.split(",")
    if "vllm" in servers and (vllm_python() is None or args.base_url):
        print(f"(vLLM side left out: {MISSING if vllm_python() is None else '--base-url given'})")
        servers = [s for s in servers if s != "vllm"]
    print(machine_line((args.threads,)))
    print(f"{args.num_requests} requests, prompts {args.input_len[0]}-{args.input_len[1]} tokens, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, tiny target on CPU, each server pinned to "
          f"{args.threads} core(s), {args.kv_cache_memory_bytes >> 20} MiB KV cache"
          + (", mini-vLLM with --async-scheduling" if args.mini_async_scheduling else "")
          + (f", mini-vLLM with {args.mini_flags}" if args.mini_flags else ""))
    rows, texts, bench = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for which in servers:
            log = open(os.path.join(tmp, f"{which}.log"), "w")
            proc, url = ((None, args.base_url) if args.base_url else
                         start_server(args.threads, args.kv_cache_memory_bytes, which, log=log,
                                      mini_flags=tuple(shlex.split(args.mini_flags))
                                      + (("--async-scheduling",) if args.mini_async_scheduling else ())))
            try:
                rows[which], texts[which] = client_runs(url, reqs, args.rates, args.seed)
                if vllm_python() is not None:
                    for rate in args.vllm_bench_rates:
                        bench[which, rate] = vllm_bench_serve(url, rate, args, tmp)
            finally:
                if proc is not None:
                    proc.terminate()
                    proc.wait(60)
    for which in servers:
        print_rows("mini-vLLM server" if which == "mini" else "vLLM server", rows[which])
    if len(texts) == 2:
        same = sum(a == b for a, b in zip(texts["mini"], texts["vllm"]))
        print(f"\nstreamed texts identical across the two servers: {same}/{len(reqs)}")
        if same == len(reqs):
            print("mini-vLLM / vLLM token throughput (this client): " + ", ".join(
                f"{m['run']}: {m['tok_per_s'] / v['tok_per_s']:.2f}x" for m, v in zip(rows["mini"], rows["vllm"])))
    if bench:
        print_vllm_bench(bench)


if __name__ == "__main__":
    main()
