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


def _host_profile(engine, steps: int, top: int = 20, interval_s: float = 2e-4) -> list[str]:
    """Where the host's time goes over `steps` decode steps, in every thread (the
    asynchronous engine prepares and launches a step in its step thread, which a
    per-thread profiler such as cProfile would miss): a sampler thread reads every
    thread's stack each `interval_s` and counts, per thread, the innermost
    function (own time) and every function on the stack (inclusive time)."""
    import collections
    import sys
    import threading

    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    own, incl, samples = collections.Counter(), collections.Counter(), collections.Counter()
    done = threading.Event()

    def where(f) -> str:
        return f"{f.f_code.co_name} ({'/'.join(f.f_code.co_filename.split('/')[-2:])}:{f.f_code.co_firstlineno})"

    def sample() -> None:
        while not done.wait(interval_s):
            for tid, frame in sys._current_frames().items():
                if tid == sampler.ident:
                    continue
                name = "main" if tid == me else names.get(tid, str(tid))
                samples[name] += 1
                own[(name, where(frame))] += 1
                seen, f = set(), frame
                while f is not None:
                    seen.add(where(f))
                    f = f.f_back
                for w in seen:
                    incl[(name, w)] += 1

    sampler = threading.Thread(target=sample, name="host-sampler", daemon=True)
    sampler.start()
    for _ in range(steps):
        engine.step()
    done.set()
    sampler.join()
    lines = [f"{steps} steps; samples per thread: {dict(samples)}"]
    for title, counts in (("own", own), ("inclusive", incl)):
        lines.append(f"-- {title}: % of the thread's samples, thread, function")
        lines += [f"{100 * c / samples[t]:5.1f}%  {t:<12} {w}" for (t, w), c in counts.most_common(top if title == "own" else 2 * top)]
    return lines


def _profile_batch(engine, batch: int, plan: Plan, vocab: int, host_profile: bool = False) -> dict:
    from mini_vllm import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(batch)
    steps = plan.profile_steps
    wall_steps = 2 * steps
    host_steps = 8 * steps if host_profile else 0
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
