"""Qwen3-MoE offline throughput side by side with real vLLM 0.32 (CPU, fp32, greedy).

The model: `moe_checkpoints.py`'s "moe-bench", a random CPU-sized Qwen3-MoE
(hidden 256, 4 layers, 32 experts of width 256, top-4 renormalised): small
enough to run in minutes on 2 cores, large enough (100 MB of expert weights)
that a step reads its experts from memory, not from cache. The engine's
experts run through `dispatch.fused_experts` (on a CPU: its CPU path once that
lands, the reference loop until then; printed below); vLLM's through
`fused_moe/experts/cpu_moe.py`.

Workload: NUM_REQUESTS requests of 16-128 random prompt tokens and 32-64 output
tokens, ignore_eos, all submitted at once. Equal settings: block size 32 (vLLM's
CPU attention needs a multiple of 32), 256 MiB of KV cache, max_num_seqs 64,
prefix caching off, both eager (vLLM's compile would take minutes; the course's
CPU default is eager), the same pinned cores. Before timing, both engines' greedy
tokens and top-5 logprobs on the first 16 requests must agree (vllm_diff's
rules, logprobs within CHECK_TOL). Reported per thread count: best of --runs wall times of each engine and
mini-vLLM / vLLM output tok/s. Goal: >= 1.0x. The first line is the machine.

Run (one benchmark at a time on a shared machine):
    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_moe_vs_vllm.py [--threads 1,2] [--runs 2]
"""
from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from machine import machine_line
from moe_checkpoints import MOE_KINDS, moe_checkpoint
from vllm_diff import compare_phase
from vllm_side import MISSING, pin, request, run_mini, run_vllm, vllm_python

KIND = "moe-bench"
NUM_REQUESTS = 64
# Logprobs within 1e-2 here, not the differential test's 1e-4 (tokens must still be equal): rounding
# moves this wider, deeper model's logits by ~1e-3 (transformers' own fp32 and fp64 runs differ by
# 1.0e-3, its dense twin's by 2.6e-5: the routing amplifies rounding, most likely where a token's k-th
# and (k+1)-th experts nearly tie); the differential test's models are the ones held to 1e-4.
CHECK_TOL = 1e-2
SETTINGS = dict(block_size=32, kv_cache_memory_bytes=256 << 20, max_num_seqs=64, enable_prefix_caching=False)


def workload(n: int, logprobs: int | None = None) -> dict:
    rng = random.Random(7)
    reqs = [request([rng.randrange(2, 6144) for _ in range(rng.randint(16, 128))], temperature=0.0,
                    ignore_eos=True, max_tokens=rng.randint(32, 64), logprobs=logprobs)
            for _ in range(NUM_REQUESTS)]
    return {"name": "timed" if logprobs is None else "check", "requests": reqs[:n]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    print(machine_line(threads), flush=True)
    if vllm_python() is None:
        print(MISSING)
        return 0
    from mini_vllm.models.fused_moe.dispatch import select_impl
    import torch

    cfg = MOE_KINDS[KIND]
    print(f"model {KIND}: {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}, width "
          f"{cfg['moe_intermediate_size']}, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, fp32; "
          f"engine experts: {select_impl(torch.zeros(1))}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = moe_checkpoint(Path(tmp), KIND)
        check, timed = workload(16, logprobs=5), workload(NUM_REQUESTS)
        out_tokens = sum(r["sampling"]["max_tokens"] for r in timed["requests"])
        print(f"{NUM_REQUESTS} requests, {out_tokens} output tokens; best of {args.runs} runs", flush=True)
        print("| threads | mini-vLLM tok/s | vLLM tok/s | mini-vLLM / vLLM |\n|---|---|---|---|")
        for t in threads:
            pin(t)
            want = run_vllm(path, [check] + [timed] * args.runs, threads=t, enforce_eager=True, **SETTINGS)
            got = run_mini(str(path), [check] + [timed] * args.runs, enforce_eager=True, **SETTINGS)
            compared, total, problems = compare_phase(want["phases"][0], got["phases"][0], top_k=5,
                                                      fields=("finish_reason",), tol=CHECK_TOL)
            if problems or compared < 0.9 * total:
                print(f"tokens differ from vLLM at {t} threads ({compared}/{total} compared):\n" +
                      "\n".join(problems[:5]))
                return 1
            mine = out_tokens / min(p["wall_s"] for p in got["phases"][1:])
            theirs = out_tokens / min(p["wall_s"] for p in want["phases"][1:])
            print(f"| {t} | {mine:.0f} | {theirs:.0f} | {mine / theirs:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
