"""Offline throughput with an fp8 KV cache (CPU), side by side with real vLLM's fp8 run, and the
KV capacity an fp8 cache gains.

Workloads: `bench_engine_throughput.py`'s (`--model tiny`: 256 requests on the tiny target in
fp32; `--model qwen3-0.6b`: 16 requests on a Qwen3-0.6B-shaped bf16 checkpoint), with its equal
settings for both engines (block size 32, 1 GiB of KV cache, the same pinned cores, vLLM in its
default compiled configuration through `vllm_runner.py --session`, a rest of SETTLE_S before
every timed run). Per thread count, interleaved runs of:
* vLLM with `kv_cache_dtype="fp8"` (scale 1.0 on both sides) where its CPU build takes one
  (x86 with AVX-512 or AMX; elsewhere it refuses, `_get_attn_isa` in
  `vllm/v1/attention/backends/cpu_attn.py`, and this script says so and times vLLM's
  unquantized run instead, as context, not as the goal's ratio);
* mini-vLLM with `kv_cache_dtype="fp8"` and with "auto".
Printed: the median [min-max] of each, mini-vLLM fp8 / vLLM fp8 output tok/s (goal >= 1.0x),
mini-vLLM fp8 / auto, and how many requests came out identical to vLLM's. Before timing, the
first 64 requests run through both engines with logprobs; differences are printed, not fatal
when vLLM ran unquantized (fp8 moves logprobs by up to ~0.6 on the tiny model, see
`fp8_kv_accuracy.py`).

KV capacity: tokens that fit in the 1 GiB budget per KV-cache dtype (the worker's own block
arithmetic, `kv_bytes_per_block`): fp8 holds 2x bf16's and 4x fp32's.

Where the time goes: both caches run the C++ attention kernel (an fp8 byte widened by bit
arithmetic, `kernels/csrc/attn_formats.h`) inside the flat CPU step (`models/cpu_step.py`,
which quantises K/V as it writes them); kernels/NOTES.md has the measurements.

Run (one benchmark at a time across the machine):
    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_fp8_kv_vs_vllm.py [--model tiny|qwen3-0.6b]
        [--threads 1,2] [--runs 3] [--no-vllm]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench_engine_throughput import SETTLE_S, WORKLOADS, engine_run, phase, summary
from engine_workloads import sample_requests
from machine import cpu_info, machine_line
from mini_vllm import LLM
from mini_vllm.kernels.kv_cache_dtype import resolve_kv_cache_dtype
from mini_vllm.models.config import ModelConfig
from mini_vllm.worker.cache_engine import kv_bytes_per_block
from vllm_diff import compare_phase
from vllm_side import MISSING, VllmSession, pin, run_mini, vllm_job, vllm_python

CHECKED = 64


def vllm_fp8_refusal() -> str | None:
    isa = cpu_info()["isa"]
    if "AVX-512F" in isa or "AMX-BF16" in isa:
        return None
    return ("vLLM's CPU build refuses kv_cache_dtype fp8 on this CPU ('FP8 KV cache on CPU requires x86 with "
            f"AVX-512 or AMX'; ISA here: {', '.join(isa)})")


def capacity(wl) -> None:
    mc = ModelConfig.from_json(wl.path() / "config.json")
    budget, bs = wl.settings["kv_cache_memory_bytes"], wl.settings["block_size"]
    rows = {}
    for kv in ("auto", "fp8"):
        dtype = resolve_kv_cache_dtype(kv, getattr(torch, {"float32": "float32", "bfloat16": "bfloat16"}[wl.dtype]))
        per_block = kv_bytes_per_block(mc.num_hidden_layers, bs, mc.num_key_value_heads, mc.head_dim, dtype)
        rows[kv] = budget // per_block * bs
    print(f"KV capacity in {budget >> 20} MiB: {rows['auto']} tokens ({wl.dtype}), {rows['fp8']} tokens (fp8): "
          f"{rows['fp8'] / rows['auto']:.2f}x")


def check(vs, reqs, wl, quantized_both: bool) -> None:
    chk = phase("check", reqs[:CHECKED], logprobs=2, detokenize=wl.detokenize)
    want = vs.run(chk)
    got = run_mini(str(wl.path()), [chk], dtype=wl.dtype, kv_cache_dtype="fp8", **wl.settings)["phases"][0]
    compared, total, problems = compare_phase(want, got, top_k=0, fields=(), margin=1e-3, tol=1e-3)
    what = "vLLM's fp8 run" if quantized_both else "vLLM's unquantized run (context only)"
    print(f"  check against {what}: {compared}/{total} positions compared, {len(problems)} differences"
          + (f"; first: {problems[0]}" if problems else ""))
    if quantized_both and problems:
        raise SystemExit("fp8 tokens differ from vLLM's fp8 run, not timing")


def run_threads(reqs, wl, n: int, runs: int, use_vllm: bool, refusal: str | None) -> None:
    useful = sum(m for _, m in reqs)
    llms = {kv: LLM(str(wl.path()), dtype=wl.dtype, kv_cache_dtype=kv, **wl.settings) for kv in ("fp8", "auto")}
    for llm in llms.values():
        engine_run(reqs[:16], llm, detokenize=wl.detokenize)  # warm-up (kernels compiled or loaded on first use)
    t_m = {kv: [] for kv in llms}
    t_v, same = [], []
    vllm_kv = "fp8" if refusal is None else "auto"
    session = (VllmSession(vllm_job(str(wl.path()), [], dtype=wl.dtype, threads=n, kv_cache_dtype=vllm_kv,
                                    **wl.settings)) if use_vllm else None)
    try:
        if session is not None:
            print(f"  vLLM {session.info['vllm_version']} ({vllm_kv}) up in {session.info['load_s']:.0f} s")
            check(session, reqs, wl, refusal is None)
        for r in range(runs):
            if session is not None:
                time.sleep(SETTLE_S)
                res = session.run(phase(f"run{r}", reqs, detokenize=wl.detokenize))
                t_v.append(res["wall_s"])
            for kv, llm in llms.items():
                time.sleep(SETTLE_S)
                t, toks = engine_run(reqs, llm, detokenize=wl.detokenize)
                t_m[kv].append(t)
                if session is not None and kv == "fp8":
                    same.append(sum(o["outputs"][0]["token_ids"] == g for o, g in zip(res["results"], toks)))
    finally:
        if session is not None:
            session.close()
    for kv in llms:
        print(f"  mini-vLLM kv {kv:<5} {summary(t_m[kv], useful)}")
    med = {kv: statistics.median(t) for kv, t in t_m.items()}
    print(f"  mini-vLLM fp8 / auto output tok/s: {med['auto'] / med['fp8']:.2f}x")
    if t_v:
        print(f"  vLLM kv {vllm_kv:<10} {summary(t_v, useful)}  fp8 requests identical per run: {same} of {len(reqs)}")
        ratio = statistics.median(t_v) / med["fp8"]
        label = "mini-vLLM fp8 / vLLM fp8" if refusal is None else "mini-vLLM fp8 / vLLM unquantized (context)"
        print(f"  {label} output tok/s (medians): {ratio:.2f}x" + ("  (goal >= 1.0x)" if refusal is None else ""))
    for llm in llms.values():
        llm.shutdown()


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(WORKLOADS), default="tiny")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    wl = WORKLOADS[args.model]
    threads = [int(x) for x in args.threads.split(",")]
    reqs = sample_requests(args.num_requests or wl.num_requests, wl.in_range, wl.out_range, seed=0)
    print(machine_line(threads))
    print(f"{wl.name} ({wl.dtype}): {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
          f"{sum(m for _, m in reqs)} output tokens; both engines: {wl.settings}")
    capacity(wl)
    use_vllm = not args.no_vllm and vllm_python() is not None
    if not use_vllm and not args.no_vllm:
        print(f"(no side-by-side run: {MISSING})")
    refusal = vllm_fp8_refusal()
    if use_vllm and refusal:
        print(f"({refusal}: vLLM runs unquantized here, as context; the goal's ratio needs such a CPU)")
    for n in threads:
        pin(n)
        print(f"\n== {n} thread(s), pinned to cores {sorted(os.sched_getaffinity(0))}")
        run_threads(reqs, wl, n, args.runs, use_vllm, refusal)


if __name__ == "__main__":
    main()
