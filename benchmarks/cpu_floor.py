"""The read floor of a CPU engine run: what every step had to read, over the bandwidth this
machine measured, against what the step took.

Decode on a CPU reads every weight once a step and every running sequence's whole KV
cache; at the batch sizes a laptop serves, those bytes over the core's read bandwidth
are the time a step cannot beat. The costing is the GPU check's (`gpu_check_parts/
roofline.py`: `ModelCost`, `step_cost`, `ScheduleRecorder`); only the two rates are the
CPU's: the read bandwidth `machine.read_bandwidth` measures with the same thread count,
and the fp32 FLOP rate of a square matmul (prefill steps are bound by arithmetic).

The run is in process (the recorder wraps the scheduler, which a separate engine-core
process would hide): one step lasts from its `schedule()` to the next one's, so it
includes the scheduler, the runner's host work and the output processing, as a user
sees. Reported: the whole run against its floor, and the pure decode steps in buckets of
batch size, each as `floor / wall` = the fraction of the floor the engine reached
(1.0 = at the floor; issue goal: >= 0.8 for decode steps at batch <= 16).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from gpu_check_parts.roofline import ModelCost, ScheduleRecorder, StepRecord, account, floor_s, phase_of, step_cost
from machine import read_bandwidth

BUCKETS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 1 << 30))
GOAL_FRACTION = 0.8   # floor / wall on decode steps at batch <= GOAL_MAX_BATCH
GOAL_MAX_BATCH = 16
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def cpu_matmul_flops(threads: int, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` fp32 n x n matmuls on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # first call: allocation and the BLAS's set-up are not arithmetic
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        return 2 * n ** 3 / best
    finally:
        torch.set_num_threads(before)


def model_cost(model_dir: str | Path, dtype: str) -> ModelCost:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return ModelCost.from_config(cfg, dtype_bytes=DTYPE_BYTES[dtype])


def decode_buckets(m: ModelCost, steps: list[StepRecord], end_t: float, bw: float, peak: float) -> list[dict]:
    """Pure decode steps grouped by batch size: steps, wall, floor, floor / wall."""
    rows = []
    for lo, hi in BUCKETS:
        wall = floor = 0.0
        n = 0
        for i, s in enumerate(steps):
            if phase_of(s) != "decode" or not lo <= len(s.seqs) <= hi:
                continue
            n += 1
            wall += (steps[i + 1].t if i + 1 < len(steps) else end_t) - s.t
            floor += floor_s(step_cost(m, s), bw, peak)
        if n:
            rows.append({"batch": (lo, hi), "steps": n, "wall_s": wall, "floor_s": floor,
                         "fraction": floor / wall if wall else None})
    return rows


def measure(llm, reqs, model_dir: str | Path, dtype: str, threads: int, detokenize: bool = True) -> dict:
    """Runs `reqs` [(prompt ids, max_tokens)] through the in-process `llm` with the
    scheduler recorded; returns the accounting, the decode buckets and both rates."""
    from mini_vllm import SamplingParams

    core = llm.llm_engine.engine_core
    if not hasattr(core, "engine_core"):
        raise ValueError("the floor run needs the engine core in this process (multiprocess_mode=False)")
    m = model_cost(model_dir, dtype)
    bw = read_bandwidth(threads) * 1e9
    peak = cpu_matmul_flops(threads)
    sps = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=detokenize) for _, n in reqs]
    rec = ScheduleRecorder(core.engine_core.scheduler)
    try:
        llm.generate([{"prompt_token_ids": p} for p, _ in reqs], sps, use_tqdm=False)
        end = time.perf_counter()
    finally:
        rec.close()
    acc = account(m, rec.steps, end, bw, peak)
    acc["decode_buckets"] = decode_buckets(m, rec.steps, end, bw, peak)
    acc["threads"] = threads
    return acc


def report_lines(acc: dict) -> list[str]:
    """The floor as printed beside every CPU benchmark's timings."""
    gb = acc["copy_bytes_per_s"] / 1e9
    lines = [f"  floor ({acc['threads']} thread(s), read bandwidth {gb:.1f} GB/s, fp32 matmul "
             f"{acc['peak_flops'] / 1e9:.0f} GFLOP/s; weights {acc['weight_bytes'] / 1e6:.1f} MB and "
             f"{acc['kv_bytes_per_token'] / 1e3:.1f} kB of KV per token read each step): "
             f"run {acc['wall_s']:.2f} s against a floor of {acc['floor_s']:.2f} s = "
             f"{acc['floor_s'] / acc['wall_s']:.0%} of the floor"]
    for name, ph in acc["phases"].items():
        if ph["steps"]:
            lines.append(f"    {name:<7} {ph['steps']:5d} steps  {ph['wall_s']:7.2f} s  floor {ph['floor_s']:7.2f} s  "
                         f"{ph['floor_s'] / ph['wall_s']:.0%} of the floor")
    for row in acc["decode_buckets"]:
        lo, hi = row["batch"]
        span = f"{lo}" if lo == hi else f"{lo}-{hi}" if hi < 1 << 20 else f">={lo}"
        goal = ""
        if hi <= GOAL_MAX_BATCH:
            goal = f"  (goal >= {GOAL_FRACTION:.0%}: {'MET' if row['fraction'] >= GOAL_FRACTION else 'NOT MET'})"
        lines.append(f"    decode batch {span:<7} {row['steps']:5d} steps  {row['wall_s'] / row['steps'] * 1e3:7.2f} ms "
                     f"a step, floor {row['floor_s'] / row['steps'] * 1e3:7.2f} ms: {row['fraction']:.0%}{goal}")
    return lines
