"""Decode steps under `torch.profiler`: how much of a step the device is busy.

vLLM counterpart: `vllm/profiler/` and `benchmarks/benchmark_latency.py
--profile`. A decode step's wall time is the device's work plus whatever the
host adds around it (scheduling, input preparation, kernel launches, the
sampled tokens' copy back). When the host's share dominates, the device idles
between kernels: the gap that CUDA graphs close.

Per batch size: that many requests with `profile_prompt_len`-token prompts
are prefilled, then (after two warm-up steps) `profile_steps` pure decode
steps are timed without the profiler (wall time) and the same number again
under it (device-busy time: the union of the intervals of the device's
kernels and copies). On a CPU there is no device timeline; the union of the
intervals of `aten::` operators stands in for it, so the shape of the report
(and this code) is the same.
"""
from __future__ import annotations

import time

import torch

from gpu_check_parts.plan import Plan, engine_args


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def busy_us(prof, device: str) -> tuple[float, str]:
    """(microseconds, how): the union of the device's (on CPU: aten operators')
    intervals; if the profiler lists no device events, the sum of the
    operators' self device time (kernels of one stream do not overlap)."""
    from torch.autograd import DeviceType

    events = prof.events()
    if device == "cuda":
        spans = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        if not spans:
            total = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
            return float(total), "sum of self device time"
        return union_length(spans), "union of device event intervals"
    spans = [(e.time_range.start, e.time_range.end) for e in events
             if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    return union_length(spans), "union of aten operator intervals"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _profile_batch(engine, batch: int, plan: Plan, vocab: int) -> dict:
    from mini_vllm import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(batch)
    steps = plan.profile_steps
    params = SamplingParams(max_tokens=4 * steps + 8, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = torch.randint(0, vocab, (plan.profile_prompt_len,), generator=gen).tolist()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    sched = engine.engine_core.engine_core.scheduler
    while any(sched.requests[r].num_output_tokens < 1 for r in ids):  # prefill everyone
        engine.step()
    for _ in range(2):
        engine.step()
    walls = []
    for _ in range(steps):
        _sync(plan.device)
        t = time.perf_counter()
        engine.step()  # returns after the sampled tokens reached the host
        walls.append(time.perf_counter() - t)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if plan.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        _sync(plan.device)
    running = sum(1 for r in ids if sched.requests.get(r) is not None and not sched.requests[r].is_finished())
    busy, how = busy_us(prof, plan.device)
    busy = busy / 1e3 / steps
    engine.abort_request(ids)
    wall = sum(walls) / steps * 1e3
    return {"batch": batch, "running_during_profile": running, "wall_ms_per_step": wall,
            "device_busy_ms_per_step": busy, "wall_over_busy": wall / busy if busy else None,
            "host_ms_per_step": wall - busy, "busy_method": how}


def run(model_dir: str, plan: Plan, vocab: int) -> dict:
    from mini_vllm import LLMEngine

    engine = LLMEngine.from_engine_args(model_dir, **engine_args(plan))
    rows = [_profile_batch(engine, b, plan, vocab) for b in plan.profile_batches]
    engine.shutdown()
    del engine
    first = rows[0]
    return {"steps_per_batch": plan.profile_steps, "prompt_len": plan.profile_prompt_len,
            "busy_source": "CUDA kernels and copies" if plan.device == "cuda" else "aten operators (CPU)",
            "rows": rows, "batch1_wall_over_busy": first["wall_over_busy"] if first["batch"] == 1 else None}
