"""Decode steps under `torch.profiler`: how much of a step the device is busy.

vLLM counterpart: `vllm/profiler/` and `benchmarks/benchmark_latency.py
--profile`. A decode step's wall time is the device's work plus whatever the
host adds around it (scheduling, input preparation, kernel launches, the
sampled tokens' copy back). When the host's share dominates, the device idles
between kernels: the gap that CUDA graphs close.

Per batch size: that many requests with `profile_prompt_len`-token prompts
are prefilled, then (after two warm-up steps) twice `profile_steps` pure
decode steps are timed back to back without the profiler (wall time: steady
state, so an asynchronous engine's overlap of host and device counts) and
`profile_steps` more under it (device-busy time: the union of the intervals of the device's
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


def _host_profile(engine, steps: int) -> list[str]:
    """Host microseconds per decode step in each phase, over `steps` steps: a
    timer around the scheduler's, the runner's and the front end's methods (the
    asynchronous engine runs the runner's in its step thread, the others in the
    calling thread, so the phases of the two threads overlap). A phase's time
    includes waiting for the GIL held by the other thread."""
    import collections
    import functools

    from mini_vllm.worker import async_output

    core = engine.engine_core.engine_core
    runner = core.executor.driver_worker.model_runner
    mf = runner.model_forward
    spent, calls = collections.Counter(), collections.Counter()
    restore = []

    def timed(owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr)
        had_own = isinstance(owner, type) or attr in vars(owner)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t
                calls[label] += 1
        setattr(owner, attr, wrapper)
        restore.append(lambda: setattr(owner, attr, fn) if had_own else delattr(owner, attr))

    for owner, attr, label in [
            (engine.engine_core, "get_output", "main: get_output (whole core step)"),
            (core.scheduler, "schedule", "main: scheduler.schedule"),
            (core.scheduler, "update_from_output", "main: scheduler.update_from_output"),
            (async_output.DeferredStepOutput, "get_output", "main: wait for the step's tokens"),
            (engine, "process_engine_outputs", "main: process_engine_outputs"),
            (runner, "execute_model", "step thread: execute_model (whole)"),
            (runner, "_prepare_inputs", "step thread: _prepare_inputs (upload included)"),
            (mf, "full_graph", "step thread: graph replay call"),
            (mf.static, "fill_tokens", "step thread: fill_tokens"),
            (mf.static, "fill_decode_metadata", "step thread: fill_decode_metadata"),
            (runner.model, "compute_logits", "step thread: compute_logits"),
            (runner.step_sampler, "sample_on_device", "step thread: sampler"),
            (runner.outputs, "settle", "step thread: settle (previous step's tokens)")]:
        if getattr(owner, attr, None) is not None:
            timed(owner, attr, label)
    try:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t
    finally:
        for undo in reversed(restore):
            undo()
    lines = [f"{steps} steps, {wall / steps * 1e6:.0f} us of wall time per step; per phase, us per step (calls):"]
    lines += [f"{spent[k] / steps * 1e6:9.1f}  ({calls[k] / steps:.1f})  {k}" for k in sorted(spent)]
    return lines


def _profile_batch(engine, batch: int, plan: Plan, vocab: int, host_profile: bool = False) -> dict:
    from mini_vllm import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(batch)
    steps = plan.profile_steps
    wall_steps = 2 * steps
    host_steps = 4 * steps if host_profile else 0
    params = SamplingParams(max_tokens=wall_steps + steps + host_steps + 8, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = torch.randint(0, vocab, (plan.profile_prompt_len,), generator=gen).tolist()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    sched = engine.engine_core.engine_core.scheduler
    while any(sched.requests[r].num_output_tokens < 1 for r in ids):  # prefill everyone
        engine.step()
    for _ in range(2):
        engine.step()
    # Wall time: steps back to back, from one step's return to another's, with no
    # synchronisation in between. With asynchronous scheduling a step returns while
    # the next one's work is still queued on the device; a sync before each step
    # would drain that pipeline and time the host and the device one after the other.
    t = time.perf_counter()
    for _ in range(wall_steps):
        engine.step()  # returns after the oldest queued step's sampled tokens reached the host
    wall = (time.perf_counter() - t) / wall_steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if plan.device == "cuda" else [])
    _sync(plan.device)  # the window then holds the kernels of exactly the steps submitted in it
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        _sync(plan.device)
    host = _host_profile(engine, host_steps) if host_profile else None
    running = sum(1 for r in ids if sched.requests.get(r) is not None and not sched.requests[r].is_finished())
    busy, how = busy_us(prof, plan.device)
    busy = busy / 1e3 / steps
    engine.abort_request(ids)
    row = {"batch": batch, "running_during_profile": running, "wall_ms_per_step": wall,
           "device_busy_ms_per_step": busy, "wall_over_busy": wall / busy if busy else None,
           "host_ms_per_step": wall - busy, "busy_method": how, "wall_steps": wall_steps}
    if host is not None:
        row["host_profile"] = host
    return row


def run(model_dir: str, plan: Plan, vocab: int) -> dict:
    from mini_vllm import LLMEngine

    engine = LLMEngine.from_engine_args(model_dir, **engine_args(plan))
    rows = [_profile_batch(engine, b, plan, vocab, host_profile=b == 1) for b in plan.profile_batches]
    engine.shutdown()
    del engine
    first = rows[0]
    return {"steps_per_batch": plan.profile_steps, "prompt_len": plan.profile_prompt_len,
            "busy_source": "CUDA kernels and copies" if plan.device == "cuda" else "aten operators (CPU)",
            "rows": rows, "batch1_wall_over_busy": first["wall_over_busy"] if first["batch"] == 1 else None}
