"""Where an eager CPU decode step's host time goes: the whole engine step, the model
forward, and the forward's time outside its kernels, split by the step's parts.

vLLM counterpart: none as a file; vLLM's CPU worker is profiled with torch.profiler
(`vllm/v1/worker/cpu_worker.py` `profile`), which sees aten ops but not the course's
ctypes kernels, hence the method below.

Method: every kernel the eager CPU forward calls is a leaf the Python side reaches
through one of three doors, and each door is wrapped with a timer for the run:
* the C++ layer ops and the C++ linear (`cpu_native.layer_ops_library().layer_op`,
  one ctypes call per op: rms norm, add + rms norm, q/k norm + rope, silu-and-mul, linear);
* the C++ paged attention (`cpu_native.library().worker`, one ctypes call per layer);
* the KV-cache write (`backends.write_kv_in_place`, or `cpu_step.write_kv` in the flat
  loop: two aten index_copy_).
"Outside kernels" is the forward's wall time minus the time inside those doors: the
module calls, the wrappers' checks, views and allocations, the custom-op dispatch and
the ctypes argument packing. Timing the doors rather than swapping the kernels for no-ops
keeps the real data flow (the numbers the next layer reads, the caches' contents); the
timer itself costs about 0.2 us a call (about 40 us a Qwen3 step), counted as kernel
time, so the host figure is, if anything, low by that much. The few aten ops left
(the embedding gather, empty tensors) count as host time.

The step is split by wrapping the engine's own methods on the instances: the
scheduler (`schedule` + `update_from_output`), the runner's input preparation
(`_update_states` + `_prepare_inputs`), the forward (`ModelForward.__call__`), the
logits (`compute_logits`: the lm_head linear, a kernel, plus its wrapper), the sampler
(`step_sampler.sample`), and the front end's output processing (`process_engine_outputs`); the
rest of the step (the runner's and core's glue) is what remains.

Workloads (1 thread, pinned to one core): tiny-py-target fp32 and the Qwen3-0.6B-shaped
random bf16 checkpoint (`engine_workloads.qwen3_06b_checkpoint`), decode steps at
batch 1 and 8 (prompts of 16 tokens, the steps after every prefill is done); of REPEATS
blocks of steps, the one with the least wall time is shown (other jobs share the machine).
MINI_VLLM_CPU_STEP=modules runs the model through its modules (the path before
`models/cpu_step.py`), for the before / after comparison.

Measured (AMD EPYC Zen 3, AVX2, 1 thread, shared machine; CPU ms per step, modules -> flat):
Qwen3-0.6B bf16 batch 1: step 93.7 -> 76.6, forward outside kernels 19.0 -> 1.0; batch 8:
step 224.4 -> 211.1, outside kernels 23.5 -> 1.6; tiny-py-target fp32 batch 1: step 4.8 -> 2.0,
outside kernels 2.7 -> 0.3. What stays outside the forward at Qwen3 batch 1: input preparation
0.5 ms, the lm_head's wrapper 0.3, the sampler 0.3 (with its arithmetic over 151,936 logits),
scheduler and output processing 0.1, the runner's and core's glue 0.2.

Run: flock /tmp/bench.lock .venv/bin/python benchmarks/bench_step_overhead.py [--steps 30]
"""
from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import torch

from engine_workloads import qwen3_06b_checkpoint
from machine import machine_line
from mini_vllm import LLM, SamplingParams
from mini_vllm.attention import backends
from mini_vllm.course.tiny_models import model_path
from mini_vllm.kernels import cpu_native
from mini_vllm.models import cpu_step

PROMPT_TOKENS = 16
REPEATS = 3
SETTINGS = dict(block_size=32, kv_cache_memory_bytes=1 << 28, max_num_seqs=16, max_num_batched_tokens=512,
                enable_prefix_caching=False, multiprocess_mode=False)


# The engine thread's CPU time, not the wall clock: on a shared machine a step is often
# descheduled, and wall time then charges another job's seconds to whichever part was running.
# At one thread every kernel runs on this thread, so its CPU time is the step's work. A reading
# costs 2 us on the test machine's VM (a system call), and each kernel call is timed with
# two: `door_overhead` measures what that adds outside and inside the timed span, and the
# table takes it off the host and kernel times.
_now = time.thread_time


class Clock:
    """Seconds and calls per name; `inside` marks the forward, so that kernel time is
    counted where it was spent (forward or logits)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.where = "other"

    def wrap(self, name: str, fn, region: str | None = None):
        def timed(*args, **kwargs):
            before, self.where = self.where, region or self.where
            t = _now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += _now() - t
                self.calls[name] += 1
                self.where = before
        return timed

    def kernel(self, fn):
        def timed(*args):
            t = _now()
            try:
                return fn(*args)
            finally:
                self.seconds[f"kernel:{self.where}"] += _now() - t
                self.calls[f"kernel:{self.where}"] += 1
        return timed


def door_overhead(calls: int = 20000) -> tuple[float, float]:
    """(seconds the timer adds outside the timed span, seconds inside it) per timed call."""
    clock, noop = Clock(), lambda: None
    timed = clock.kernel(noop)
    t = _now()
    for _ in range(calls):
        noop()
    plain = _now() - t
    t = _now()
    for _ in range(calls):
        timed()
    total = (_now() - t - plain) / calls
    inside = clock.seconds["kernel:other"] / calls
    return max(0.0, total - inside), inside


class _TimedLibrary:
    """A ctypes library whose kernel entry point is timed; everything else passes through."""

    def __init__(self, lib, clock: Clock, entry: str) -> None:
        self._lib = lib
        setattr(self, entry, clock.kernel(getattr(lib, entry)))

    def __getattr__(self, name):
        return getattr(self._lib, name)


def instrument(llm, clock: Clock) -> None:
    """Wrap the kernel doors (module level) and the step's parts (on the instances)."""
    layer_lib, attn_lib = cpu_native.layer_ops_library, cpu_native.library
    timed_layer, timed_attn = {}, {}

    def layer_ops_library(n):
        lib = layer_lib(n)
        if lib is None:
            return None
        return timed_layer.setdefault(id(lib), _TimedLibrary(lib, clock, "layer_op"))

    def library():
        lib = attn_lib()
        if lib is None:
            return None
        return timed_attn.setdefault(id(lib), _TimedLibrary(lib, clock, "worker"))

    cpu_native.layer_ops_library, cpu_native.library = layer_ops_library, library
    backends.write_kv_in_place = clock.kernel(backends.write_kv_in_place)
    cpu_step.write_kv = clock.kernel(cpu_step.write_kv)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.executor.driver_worker.model_runner
    sched = core.scheduler
    sched.schedule = clock.wrap("scheduler", sched.schedule)
    sched.update_from_output = clock.wrap("scheduler", sched.update_from_output)
    runner._update_states = clock.wrap("input prep", runner._update_states)
    runner._prepare_inputs = clock.wrap("input prep", runner._prepare_inputs)
    runner.model_forward = clock.wrap("forward", runner.model_forward, region="forward")
    runner.model.compute_logits = clock.wrap("logits", runner.model.compute_logits, region="logits")
    runner.step_sampler.sample = clock.wrap("sampler", runner.step_sampler.sample)
    engine.process_engine_outputs = clock.wrap("output processing", engine.process_engine_outputs)


def decode_steps(path: str, dtype: str, batch: int, steps: int) -> dict[str, float]:
    """Milliseconds per decode step, by part, over `steps` steps at `batch` sequences."""
    llm = LLM(path, dtype=dtype, **SETTINGS)
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=REPEATS * steps + 8, temperature=0, ignore_eos=True, detokenize=False)
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, sp)
    for _ in range(4):  # the prefill, then warm decode steps (plans, packed weights, caches)
        engine.step()
    clock = Clock()
    instrument(llm, clock)
    best = None
    for _ in range(REPEATS):  # the least disturbed block of steps (the machine is shared)
        clock.seconds.clear()
        clock.calls.clear()
        t = _now()
        for _ in range(steps):
            engine.step()
        wall = _now() - t
        if best is None or wall < best[0]:
            best = wall, dict(clock.seconds), defaultdict(int, clock.calls)
    llm.shutdown()
    wall, s = best[0], defaultdict(float, best[1])
    row = {"step": wall, **{k: s[k] for k in ("scheduler", "input prep", "forward", "logits", "sampler",
                                              "output processing")}}
    out, inside = door_overhead()
    c = best[2]  # the kernel calls of that block; the timers' own cost comes off each column
    for part in ("forward", "logits"):
        row[part] -= c[f"kernel:{part}"] * (out + inside)
        row[f"{part} host"] = s[part] - s[f"kernel:{part}"] - c[f"kernel:{part}"] * out
    row["step"] -= sum(n for k, n in c.items() if k.startswith("kernel:")) * (out + inside)
    row["other"] = row["step"] - sum(row[k] for k in ("scheduler", "input prep", "forward", "logits", "sampler",
                                                      "output processing"))
    return {k: v / steps * 1e3 for k, v in row.items()}


COLUMNS = ("step", "forward", "forward host", "input prep", "logits", "logits host", "sampler", "scheduler",
           "output processing", "other")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", choices=("tiny", "qwen3"), default=None)
    args = ap.parse_args()
    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[0]])
    torch.set_num_threads(1)
    print(machine_line([1]))
    workloads = []
    if args.only != "qwen3":
        workloads += [("tiny-py-target fp32", str(model_path("tiny-py-target")), "float32", b) for b in (1, 8)]
    if args.only != "tiny":
        workloads += [("qwen3-0.6b bf16", str(qwen3_06b_checkpoint()), "bfloat16", b) for b in (1, 8)]
    print(f"CPU ms of the engine thread per decode step, 1 thread, {args.steps} steps "
          f"(MINI_VLLM_CPU_STEP={cpu_step.CPU_STEP})")
    print(f"{'workload':<22}{'batch':>6}" + "".join(f"{c:>12}" for c in COLUMNS))
    for name, path, dtype, batch in workloads:
        row = decode_steps(path, dtype, batch, args.steps)
        print(f"{name:<22}{batch:>6}" + "".join(f"{row[c]:>12.2f}" for c in COLUMNS), flush=True)


if __name__ == "__main__":
    main()
