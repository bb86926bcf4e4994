"""A profiler window on each phase of the throughput workload: busy, host-only, top kernels, GEMM rate.

vLLM counterpart: `benchmarks/benchmark_throughput.py --profile` (a torch
profiler trace of the run). Driven through the engine's own `step()`, with a
`ScheduleRecorder` so every profiled step's cost is known:

- "prefill": the first steps of a fresh copy of the workload, which carry
  its prompts (the largest steps of the run, mixed with decodes later on);
- "decode": the first steps after every prompt is in, pure decodes of the
  whole batch.

Per window: wall and device-busy time per step (on a CPU the aten operators'
union stands in for the device, as in `step_profile`), host-only time (wall -
busy), the floor of the same steps, the top kernels by device time, and the
GEMM kernels' FLOP rate against the dense peak. The windows run on a copy of
the workload drawn with another seed, before the timed run, so the prefix
cache cannot serve the timed run's prompts and the profiler's overhead
stays out of its timing.
"""
from __future__ import annotations

import time
from collections import Counter

from gpu_check_parts.roofline import (GEMM_KERNEL_MARKS, ModelCost, ScheduleRecorder, floor_s, phase_of,
                                      step_cost)
from gpu_check_parts.step_profile import _sync, busy_us

MAX_STEPS_TO_DECODE = 10_000  # bound on the steps run to get past the prompts


def top_kernels(prof, device: str, steps: int, k: int = 8) -> tuple[list[dict], float]:
    """The k kernels (CPU: aten operators) with the most self time, and the GEMMs' total self time, in us."""
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if device == "cuda" else (
            e.self_cpu_time_total if e.key.startswith("aten::") else 0)
        if us > 0:
            rows.append((us, e.key, e.count))
    rows.sort(reverse=True)
    gemm_us = sum(us for us, name, _ in rows if any(mark in name.lower() for mark in GEMM_KERNEL_MARKS))
    top = [{"name": name[:120], "us_per_step": us / steps, "calls_per_step": n / steps} for us, name, n in rows[:k]]
    return top, gemm_us


def _window(engine, rec: ScheduleRecorder, steps: int, device: str, m: ModelCost, copy_bw: float,
            peak_flops: float) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    first = len(rec.steps)
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        _sync(device)
    wall = (time.perf_counter() - t) / steps
    done = rec.steps[first:first + steps]  # under async scheduling one more may be scheduled, not yet run
    costs = [step_cost(m, s) for s in done]
    busy, how = busy_us(prof, device)
    busy = busy / 1e6 / steps
    top, gemm_us = top_kernels(prof, device, steps)
    floor = sum(floor_s(c, copy_bw, peak_flops) for c in costs) / max(1, len(costs))
    gemm_rate = sum(c["gemm_flops"] for c in costs) / (gemm_us / 1e6) if gemm_us else None
    return {"steps": len(done), "phases": dict(Counter(phase_of(s) for s in done)),
            "batch": [len(s.seqs) for s in done], "tokens": [sum(n for _, n in s.seqs) for s in done],
            "wall_ms_per_step": wall * 1e3, "busy_ms_per_step": busy * 1e3, "busy_method": how,
            "host_ms_per_step": (wall - busy) * 1e3, "floor_ms_per_step": floor * 1e3,
            "busy_over_floor": busy / floor if floor else None, "top_kernels": top,
            "gemm_us_per_step": gemm_us / steps, "gemm_flops_per_s": gemm_rate,
            "gemm_fraction_of_peak": gemm_rate / peak_flops if gemm_rate else None}


def profile_windows(llm, m: ModelCost, reqs, steps: int, device: str, copy_bw: float, peak_flops: float) -> dict:
    """Both windows on `reqs` (a workload drawn with another seed than the timed one)."""
    from mini_vllm import SamplingParams

    engine = llm.llm_engine
    rec = ScheduleRecorder(engine.engine_core.engine_core.scheduler)
    ids = [f"roofline-{i}" for i in range(len(reqs))]
    try:
        for rid, (prompt, max_tokens) in zip(ids, reqs):
            engine.add_request(rid, {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        out = {"prefill": _window(engine, rec, steps, device, m, copy_bw, peak_flops)}
        for _ in range(MAX_STEPS_TO_DECODE):  # past the prompts: the last step scheduled carried none
            if rec.steps and phase_of(rec.steps[-1]) == "decode" or not engine.has_unfinished_requests():
                break
            engine.step()
        out["decode"] = _window(engine, rec, steps, device, m, copy_bw, peak_flops)
    finally:
        engine.abort_request(ids)
        for _ in range(100):  # an asynchronous engine still holds the step it queued
            if not engine.has_unfinished_requests():
                break
            engine.step()
        rec.close()
    return out
