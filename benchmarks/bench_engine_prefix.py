"""TTFT of a request whose 768-token prefix is in the prefix cache, against cold.

The tiny target's context is 1,024 tokens: the request is a 768-token prefix
(cut from the standard library) plus a 32-token tail of its own. Warm: a first
request with the same prefix and another tail ran before, so its blocks are
cached; the measured request computes only its tail. Cold: the same request on
an engine whose cache holds nothing of it. Best of N, each on a fresh engine.
Goal >= 5x (seed 000 reports 82 -> 18 ms, 4.5x).

Run: .venv/bin/python benchmarks/bench_engine_prefix.py [--threads 1] [--trials 7]
"""
from __future__ import annotations

import argparse
import time

import torch

from engine_workloads import sample_requests
from mini_vllm.llm_engine import LLMEngine
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.tiny_models import model_path

GOAL = 5.0


def ttft(eng: LLMEngine, prompt: list[int], rid: str) -> float:
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    eng.add_request(rid, {"prompt_token_ids": prompt}, sp)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - t
    return first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trials", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    (base, _), = sample_requests(1, (768 + 64, 768 + 64), (1, 1), seed=1)
    prefix, tail_a, tail_b = base[:768], base[768:800], base[800:832]
    cold, warm = [], []
    for i in range(args.trials):
        eng = LLMEngine.from_engine_args(str(model_path("tiny-py-target")), dtype="float32",
                                         max_num_batched_tokens=1024, kv_cache_memory_bytes=64 << 20)
        ttft(eng, [5] * 16, f"w{i}")  # warm up the process (allocations, first-call costs)
        cold.append(ttft(eng, prefix + tail_b, f"c{i}"))
        eng2 = LLMEngine.from_engine_args(str(model_path("tiny-py-target")), dtype="float32",
                                          max_num_batched_tokens=1024, kv_cache_memory_bytes=64 << 20)
        ttft(eng2, [5] * 16, f"w{i}")
        ttft(eng2, prefix + tail_a, f"p{i}")  # puts the prefix in the cache
        warm.append(ttft(eng2, prefix + tail_b, f"h{i}"))
        hits = eng2.engine_core.scheduler.kv_cache_manager.prefix_cache_stats.hits
        assert hits >= 768, f"expected the 768-token prefix to hit, got {hits} hit tokens"
    c, w = min(cold), min(warm)
    print(f"TTFT cold (800-token prompt computed):      {c * 1e3:7.1f} ms (best of {args.trials})")
    print(f"TTFT warm (768 tokens from the prefix cache): {w * 1e3:7.1f} ms")
    print(f"speed-up: {c / w:.2f}x (goal >= {GOAL}x; seed 000: 82 -> 18 ms, 4.5x)  "
          f"{'MET' if c / w >= GOAL else 'NOT MET'}")


if __name__ == "__main__":
    main()
