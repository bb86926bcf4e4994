"""KV memory saved by block sharing on the real engine: parallel sampling and beam search.

Seed 001 ch. 3 (the PagedAttention evaluation) reports the memory saved by
sharing blocks: parallel sampling 6.1-9.8% (Alpaca) and 16.2-30.5%
(ShareGPT); beam search 37.6-55.2% (Alpaca) and 44.3-66.3% (ShareGPT).

Here: the tiny target (1,024-token context) serves requests whose prompt and
output lengths follow Chapter 1's synthetic ShareGPT-like and Alpaca-like
traces (`mini_vllm.paged_attention.waste.synthetic_trace`, clipped to the
context), with prompts cut from the standard library. After every
`schedule()` (the blocks a step runs with) we count the distinct KV blocks in
use and the blocks the same sequences would hold without sharing (the sum of
their block-table lengths); saving = 1 - Σ distinct / Σ unshared over the
run. Both share through prefix caching, as in vLLM v1. Parallel sampling:
the front end sends the n samples as n requests (`engine/parallel_sampling.py`),
admitted together, and each sibling hits the full prompt blocks the first one
writes in that same step; only the partly filled last block is each sample's
own. Beam search shares every common prefix of its beams (05_mini_vllm/beam_search.py
re-submits each live beam every round, and the round's requests hit the same
cached blocks). The meter reads the scheduler after every `schedule()`, so
the engine core runs in this process.

Run: .venv/bin/python benchmarks/bench_sharing.py [--requests 16] [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import torch

from engine_workloads import corpus_token_stream
from mini_vllm import LLM, SamplingParams
from mini_vllm.beam_search import BeamSearchParams, run_beam_search
from mini_vllm.paged_attention.waste import synthetic_trace
from mini_vllm.course.tiny_models import load_tiny_tokenizer, model_path

THESIS = {  # seed 001 ch. 3, memory saving ranges (%) over n / width 2..6
    ("parallel", "Alpaca"): (6.1, 9.8), ("parallel", "ShareGPT"): (16.2, 30.5),
    ("beam", "Alpaca"): (37.6, 55.2), ("beam", "ShareGPT"): (44.3, 66.3),
}
CONTEXT = 1024
WIDTHS = (2, 4, 6)


def workload(dataset: str, n: int, stream: list[int], seed: int = 0):
    """n (prompt ids, output length) pairs; prompt + output <= the model's context."""
    out, start = [], 0
    for r in synthetic_trace(dataset, num_requests=n, seed=seed):
        p = min(r.prompt_len, CONTEXT // 2)
        o = max(1, min(r.output_len, CONTEXT - p))
        out.append((stream[start:start + p], o))
        start += p
    return out


class Meter:
    """Σ distinct blocks and Σ unshared blocks, sampled after every `schedule()`
    of `core`'s scheduler, while the step's requests hold their blocks (after
    the step, beam search's one-token requests have finished and hold none)."""

    def __init__(self, core) -> None:
        self.distinct = self.unshared = self.peak = self.steps = 0
        sched, real = core.scheduler, core.scheduler.schedule

        def schedule():
            so = real()
            self(core)
            return so

        sched.schedule = schedule
        self.detach = lambda: sched.__dict__.pop("schedule", None)

    def __call__(self, core) -> None:
        kv = core.scheduler.kv_cache_manager
        tables = [kv.get_block_ids(r) for r in core.scheduler.requests]
        distinct = len({b for t in tables for b in t})
        self.distinct += distinct
        self.unshared += sum(len(t) for t in tables)
        self.peak, self.steps = max(self.peak, distinct), self.steps + 1

    @property
    def saving(self) -> float:
        return 1.0 - self.distinct / self.unshared if self.unshared else 0.0


def make_llm(max_seqs: int, prefix_caching: bool = False) -> LLM:
    return LLM(str(model_path("tiny-py-target")), dtype="float32", device="cpu",
               enable_prefix_caching=prefix_caching, max_num_seqs=max_seqs,
               kv_cache_memory_bytes=320 << 20, multiprocess_mode=False)


def run_parallel(llm: LLM, reqs, n: int) -> Meter:
    eng = llm.llm_engine
    meter = Meter(eng.engine_core.engine_core)
    for i, (prompt, out_len) in enumerate(reqs):
        sp = SamplingParams(n=n, max_tokens=out_len, temperature=1.0, seed=i, ignore_eos=True)
        eng.add_request(f"p{n}-{i}", {"prompt_token_ids": prompt}, sp)
    while eng.has_unfinished_requests():
        eng.step()
    meter.detach()
    return meter


def run_beam(llm: LLM, reqs, width: int) -> Meter:
    meter = Meter(llm.llm_engine.engine_core.engine_core)
    params = [BeamSearchParams(beam_width=width, max_tokens=o, ignore_eos=True) for _, o in reqs]
    run_beam_search(llm.llm_engine, [{"prompt_token_ids": p} for p, _ in reqs], params)
    meter.detach()
    return meter


def measure(n_requests: int, datasets=("Alpaca", "ShareGPT"), seed: int = 0, widths=WIDTHS) -> list[dict]:
    """One row per (dataset, method, n or width); each run on a fresh engine."""
    stream = corpus_token_stream(load_tiny_tokenizer())
    rows = []
    for dataset in datasets:
        reqs = workload(dataset, n_requests, stream, seed)
        for method, run in (("parallel", run_parallel), ("beam", run_beam)):
            for k in widths:
                llm = make_llm(max_seqs=k * n_requests, prefix_caching=True)
                t = time.perf_counter()
                m = run(llm, reqs, k)
                assert llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.num_free_blocks == \
                    llm.llm_engine.num_gpu_blocks, "blocks leaked"
                rows.append(dict(dataset=dataset, method=method, k=k, saving=100 * m.saving,
                                 peak=m.peak, steps=m.steps, seconds=time.perf_counter() - t))
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'workload':9} {'method':9} {'n/width':>7} {'saved %':>8} {'thesis %':>12} "
             f"{'peak blocks':>11} {'steps':>6} {'s':>6}"]
    for r in rows:
        lo, hi = THESIS[(r["method"], r["dataset"])]
        lines.append(f"{r['dataset']:9} {r['method']:9} {r['k']:>7} {r['saving']:>8.1f} "
                     f"{f'{lo}-{hi}':>12} {r['peak']:>11} {r['steps']:>6} {r['seconds']:>6.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16, help="requests per workload (default 16)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = measure(args.requests)
    print(format_rows(rows))
    print("thesis: seed 001 ch. 3, memory saved over n / beam width 2..6 on OPT-13B traces; "
          "here: tiny target, 1,024-token context, synthetic traces, block size 16")


if __name__ == "__main__":
    main()
