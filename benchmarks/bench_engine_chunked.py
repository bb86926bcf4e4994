"""Inter-token latency of running decodes while a long prompt arrives:
chunked prefill (token budget 256) against unchunked (the prompt in one step).

8 requests decode for 96 steps; at step 24 a 960-token prompt arrives. The
measured window runs from its arrival until its first token: the inter-token
latencies of the 8 decoding requests inside it are what the arrival costs
them. Without chunking, the one step that prefills the whole prompt stalls
all of them; with a budget of 256 the prefill is spread over 4 steps that
each also carry the decodes. The whole run's p99 and max are printed too (in
the whole run the stall is ~1% of all ITLs, so its p99 mostly shows ordinary
decode steps). Goal: window p99 ITL unchunked / chunked >= 4x (seed 002:
0.8 s -> 0.2 s).

Run: .venv/bin/python benchmarks/bench_engine_chunked.py [--threads 1] [--trials 3]
"""
from __future__ import annotations

import argparse
import time

import torch

from engine_workloads import sample_requests
from mini_vllm.llm_engine import LLMEngine
from mini_vllm.metrics import percentile
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.tiny_models import model_path

GOAL = 4.0


def run(chunked: bool, decode_prompts, long_prompt) -> tuple[list[float], list[float]]:
    kw = dict(max_num_batched_tokens=256) if chunked else dict(enable_chunked_prefill=False,
                                                                 max_num_batched_tokens=1024)
    eng = LLMEngine.from_engine_args(str(model_path("tiny-py-target")), dtype="float32",
                                     kv_cache_memory_bytes=64 << 20, **kw)
    sp = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    for i, p in enumerate(decode_prompts):
        eng.add_request(f"d{i}", {"prompt_token_ids": p}, sp, output_kind="delta")
    last: dict[str, float] = {}
    itls: list[float] = []
    window: list[float] = []
    in_window = False
    step = 0
    while eng.has_unfinished_requests():
        if step == 24:
            eng.add_request("long", {"prompt_token_ids": long_prompt},
                            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                            output_kind="delta")
            in_window = True
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id.startswith("d") and o.outputs and o.outputs[0].token_ids:
                if o.request_id in last:
                    itls.append(now - last[o.request_id])
                    if in_window:
                        window.append(itls[-1])
                last[o.request_id] = now
        if any(o.request_id == "long" and o.outputs and o.outputs[0].token_ids for o in outs):
            in_window = False  # its prefill is complete
        step += 1
    return itls, window


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reqs = sample_requests(9, (32, 32), (1, 1), seed=2)
    decode_prompts = [p for p, _ in reqs[:8]]
    (long_prompt, _), = sample_requests(1, (960, 960), (1, 1), seed=3)
    res = {}
    for chunked in (False, True):
        trials = [run(chunked, decode_prompts, long_prompt) for _ in range(args.trials)]
        # Least disturbed trial for each figure (the machine is shared).
        w99 = min(percentile(w, 99) for _, w in trials)
        p50 = min(percentile(t, 50) for t, _ in trials)
        p99 = min(percentile(t, 99) for t, _ in trials)
        mx = min(max(t) for t, _ in trials)
        res[chunked] = w99
        print(f"{'chunked (budget 256)' if chunked else 'unchunked':<22} window p99 {w99 * 1e3:6.1f} ms "
              f"({len(trials[0][1])} ITLs) | whole run: p50 {p50 * 1e3:5.1f} ms  p99 {p99 * 1e3:6.1f} ms  "
              f"max {mx * 1e3:6.1f} ms ({len(trials[0][0])} ITLs)")
    r = res[False] / res[True]
    print(f"window p99 ITL unchunked / chunked: {r:.2f}x (goal >= {GOAL}x)  {'MET' if r >= GOAL else 'NOT MET'}")


if __name__ == "__main__":
    main()
