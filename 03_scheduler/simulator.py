"""A model-free serving simulator: the Chapter 3 scheduler driven by a cost
model instead of a model (cf. vLLM's `benchmarks/benchmark_serving.py`
metrics), plus the baselines of seed 001 §3.8 under the same KV memory.

* `simulate_paged`       — our Scheduler over a paged KV pool (Chapter 2);
* `simulate_reservation` — Orca-style iteration-level batching where each
  request reserves Max (max_len), Pow2 or Oracle (prompt + output) slots
  up front (schemes of Chapter 1's `waste` module);
* `simulate_static`      — FasterTransformer-style static batching: a batch
  is formed when the engine is idle and runs until its longest request ends.

Every simulator advances a clock by `CostModel.step_time` per step and
records per request: arrival, first-token time, token times, finish time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mini_vllm.paged_attention.waste import next_pow2, synthetic_trace

from .config import SchedulerConfig
from .cost_model import CostModel, kv_read
from .output import ModelRunnerOutput
from .request import Request, SchedulerSamplingParams
from .scheduler import Scheduler


@dataclass
class SimRequest:
    arrival: float
    prompt_len: int
    output_len: int
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None


@dataclass
class TimelineResult:
    """What one simulated run recorded: every request's token times and every step's span,
    from which `metrics` derives latency and throughput."""
    requests: list[SimRequest]
    steps: list[tuple[float, float, list[int]]]  # (start, end, request indices)

    def metrics(self) -> dict:
        rs = [r for r in self.requests if r.finish is not None]
        ttft = np.array([r.first_token - r.arrival for r in rs])
        itl = np.concatenate([np.diff(r.token_times) for r in rs if len(r.token_times) > 1] or [[0.0]])
        norm = np.array([(r.finish - r.arrival) / r.output_len for r in rs])
        span = max(r.finish for r in rs) - min(r.arrival for r in rs)
        return {
            "finished": len(rs),
            "ttft_mean": float(ttft.mean()), "ttft_p99": float(np.percentile(ttft, 99)),
            "itl_mean": float(itl.mean()), "itl_p99": float(np.percentile(itl, 99)),
            "norm_latency": float(norm.mean()),
            "throughput_tok_s": sum(r.output_len for r in rs) / span,
            "avg_batched_reqs": float(np.mean([len(s[2]) for s in self.steps])),
        }


def make_workload(dataset: str, num_requests: int, rate: float, seed: int = 0,
                  max_len: int = 2048) -> list[SimRequest]:
    """Chapter 1's synthetic ShareGPT/Alpaca lengths with Poisson arrivals
    (exponential gaps of mean 1/rate seconds)."""
    trace = synthetic_trace(dataset, num_requests, seed)
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, num_requests)
    t = np.cumsum(gaps)
    return [SimRequest(float(a), min(r.prompt_len, max_len - 1),
                       min(r.output_len, max_len - min(r.prompt_len, max_len - 1)))
            for a, r in zip(t, trace)]


def _emit(r: SimRequest, now: float) -> None:
    if r.first_token is None:
        r.first_token = now
    r.token_times.append(now)
    if len(r.token_times) == r.output_len:
        r.finish = now


def simulate_paged(workload, cost: CostModel, config: SchedulerConfig, num_blocks: int,
                   block_size: int = 16) -> TimelineResult:
    reqs = [SimRequest(w.arrival, w.prompt_len, w.output_len) for w in workload]
    sched = Scheduler(config, num_blocks, block_size, enable_prefix_caching=False)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    live: dict[str, Request] = {}
    clock, k, steps = 0.0, 0, []
    while k < len(order) or sched.has_unfinished_requests():
        while k < len(order) and reqs[order[k]].arrival <= clock:
            i = order[k]
            r = Request(str(i), [1 + i % 50_000] * reqs[i].prompt_len,
                        SchedulerSamplingParams(max_tokens=reqs[i].output_len, ignore_eos=True),
                        arrival_time=reqs[i].arrival)
            sched.add_request(r)
            live[r.request_id] = r
            k += 1
        if not sched.has_unfinished_requests():
            clock = reqs[order[k]].arrival
            continue
        out = sched.schedule()
        if not out.num_scheduled_tokens:
            raise RuntimeError("scheduler made no progress with requests pending")
        kv = sum(kv_read(live[rid].num_computed_tokens - d, d)
                 for rid, d in out.num_scheduled_tokens.items())
        start, clock = clock, clock + cost.step_time(out.total_num_scheduled_tokens, kv)
        sampled = {}
        for rid in out.num_scheduled_tokens:
            r = live[rid]
            done = r.num_computed_tokens >= r.num_tokens
            sampled[rid] = [1] if done else []
            if done:
                _emit(reqs[int(rid)], clock)
        sched.update_from_output(out, ModelRunnerOutput.from_dict(sampled))
        steps.append((start, clock, [int(r) for r in out.num_scheduled_tokens]))
    return TimelineResult(reqs, steps)


def reservation(scheme: str, r: SimRequest, max_len: int) -> int:
    if scheme == "Orca (Max)":
        return max_len
    if scheme == "Orca (Pow2)":
        return min(r.prompt_len + next_pow2(r.output_len), max_len)
    if scheme == "Orca (Oracle)":
        return r.prompt_len + r.output_len
    raise ValueError(f"scheme must be Orca (Max|Pow2|Oracle), got {scheme!r}")


def simulate_reservation(workload, cost: CostModel, scheme: str, kv_tokens: int,
                         max_num_batched_tokens: int = 2048, max_len: int = 2048) -> TimelineResult:
    """Iteration-level FCFS batching; admission needs the whole reservation
    free and the whole prompt within the token budget (no chunking).

    A request that could never be admitted (reservation over `kv_tokens`, or
    prompt over `max_num_batched_tokens`) raises a ValueError up front, as
    `simulate_paged` does: FCFS would otherwise wait on it forever.
    """
    reqs = [SimRequest(w.arrival, w.prompt_len, w.output_len) for w in workload]
    for i, r in enumerate(reqs):
        need = reservation(scheme, r, max_len)
        if need > kv_tokens:
            raise ValueError(f"request {i}: {scheme} reserves {need} KV tokens but kv_tokens is "
                             f"{kv_tokens}; it could never be admitted")
        if r.prompt_len > max_num_batched_tokens:
            raise ValueError(f"request {i}: prompt_len {r.prompt_len} exceeds max_num_batched_tokens "
                             f"{max_num_batched_tokens}; without chunking it could never be admitted")
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    waiting, running, free = [], [], kv_tokens  # running: [idx, computed]
    clock, k, steps = 0.0, 0, []
    while k < len(order) or waiting or running:
        while k < len(order) and reqs[order[k]].arrival <= clock:
            waiting.append(order[k])
            k += 1
        if not waiting and not running:
            clock = reqs[order[k]].arrival
            continue
        batch = [(i, 1, c) for i, c in running]  # decodes
        budget = max_num_batched_tokens - len(batch)
        while waiting:
            i = waiting[0]
            need = reservation(scheme, reqs[i], max_len)
            if need > free or reqs[i].prompt_len > budget:
                break
            waiting.pop(0)
            free -= need
            budget -= reqs[i].prompt_len
            batch.append((i, reqs[i].prompt_len, 0))
            running.append([i, 0])
        tokens = sum(d for _, d, _ in batch)
        kv = sum(kv_read(c, d) for _, d, c in batch)
        start, clock = clock, clock + cost.step_time(tokens, kv)
        for entry in running:
            i = entry[0]
            entry[1] = entry[1] + (reqs[i].prompt_len if entry[1] == 0 else 1)
            _emit(reqs[i], clock)
        for entry in [e for e in running if reqs[e[0]].finish is not None]:
            running.remove(entry)
            free += reservation(scheme, reqs[entry[0]], max_len)
        steps.append((start, clock, [i for i, _, _ in batch]))
    return TimelineResult(reqs, steps)


def simulate_static(workload, cost: CostModel, kv_tokens: int, max_len: int = 2048) -> TimelineResult:
    """Static batching: batch size = kv_tokens // max_len (every slot reserves
    max_len); the batch prefills together and decodes until all are done."""
    reqs = [SimRequest(w.arrival, w.prompt_len, w.output_len) for w in workload]
    bsz = max(1, kv_tokens // max_len)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    clock, k, steps = 0.0, 0, []
    while k < len(order):
        clock = max(clock, reqs[order[k]].arrival)
        batch = []
        while k < len(order) and len(batch) < bsz and reqs[order[k]].arrival <= clock:
            batch.append(order[k])
            k += 1
        pre = [reqs[i].prompt_len for i in batch]
        start, clock = clock, clock + cost.step_time(sum(pre), sum(kv_read(0, p) for p in pre))
        steps.append((start, clock, list(batch)))
        for i in batch:
            _emit(reqs[i], clock)
        for t in range(1, max(reqs[i].output_len for i in batch)):
            # Finished requests still occupy their slot (padding) until the end.
            kv = sum(reqs[i].prompt_len + t for i in batch)
            start, clock = clock, clock + cost.step_time(len(batch), kv)
            steps.append((start, clock, list(batch)))
            for i in batch:
                if reqs[i].finish is None:
                    _emit(reqs[i], clock)
    return TimelineResult(reqs, steps)
