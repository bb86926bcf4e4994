"""Engine output tok/s on nano-vllm's benchmark workload, against HF `generate`.

vLLM counterpart: `benchmarks/benchmark_throughput.py` (offline throughput);
the workload is nano-vllm's `bench.py`: 256 sequences, random token ids in
[0, 10000], prompt lengths 100-1024, output lengths 100-1024, ignore_eos,
drawn from Python's `random` seeded 0 in the same order as that script.
All runs are greedy (nano-vllm samples at temperature 0.6; greedy makes the
token check below possible and costs the same).

Order: the engine (warm-up requests, then the whole workload timed), then
HF in bf16 for the greedy check of the first requests, then HF's static
batches and HF's continuous batching. The engine is freed before HF loads.
"""
from __future__ import annotations

import random
import time

import torch

from gpu_check_parts import attention_bw, greedy_check, hf_baselines, roofline, roofline_profile
from gpu_check_parts.plan import Plan, engine_args, free_device_memory


def nano_vllm_workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], max_token_id: int,
                       seed: int = 0) -> list[tuple[list[int], int]]:
    """[(prompt_token_ids, max_tokens)]; nano-vllm's draw order: all prompts, then all output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    return [(p, rng.randint(*output_len)) for p in prompts]


def _engine_run(model_dir: str, plan: Plan, reqs, device_name: str) -> tuple[dict, list[list[int]]]:
    from mini_vllm import LLM, SamplingParams

    llm = LLM(model_dir, **engine_args(plan))
    # Warm-up: Triton compiles a kernel variant per specialisation of its integer
    # arguments (== 1, multiple of 16, other); 17 requests finishing one per step
    # run batches of 17 down to 1, so the timed run compiles nothing.
    warm = min(17, plan.max_num_seqs)
    llm.generate([{"prompt_token_ids": [1 + i, 2, 3]} for i in range(warm)],
                 [SamplingParams(max_tokens=1 + i, temperature=0, ignore_eos=True) for i in range(warm)],
                 use_tqdm=False)
    # The roofline's bandwidth and FLOP peak, and its profiler windows on a copy of the
    # workload drawn with another seed (no prefix-cache hits on the timed prompts).
    cost = roofline.ModelCost.from_config(roofline.config_of(model_dir), dtype_bytes=2)
    copy_bw = attention_bw.copy_bandwidth(plan.device, plan.small)
    measured = roofline.measured_matmul_flops(plan.device, plan.small)
    published = roofline.published_flops(device_name) if plan.device == "cuda" else None
    peak = published or measured
    other = nano_vllm_workload(plan.num_requests, plan.prompt_len, plan.output_len, plan.max_token_id, seed=1)
    windows = roofline_profile.profile_windows(llm, cost, other, plan.roofline_profile_steps, plan.device,
                                               copy_bw, peak)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
    core = llm.llm_engine.engine_core.engine_core
    recorder = roofline.ScheduleRecorder(core.scheduler)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    end = time.perf_counter()
    seconds = end - start
    recorder.close()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(len(t) for t in tokens)
    wrong = [i for i, (t, (_, m)) in enumerate(zip(tokens, reqs)) if len(t) != m]
    rf = roofline.account(cost, recorder.steps, end, copy_bw, peak)
    rf.update(peak_source="published dense bf16" if published else "measured matmul", measured_matmul_flops=measured,
              windows=windows, engine_over_floor=seconds / rf["floor_s"] if rf["floor_s"] else None)
    result = {"seconds": seconds, "output_tokens": n_out, "tok_per_s": n_out / seconds, "roofline": rf,
              "num_gpu_blocks": core.num_gpu_blocks, "preemptions": core.scheduler.num_preemptions,
              "requests_with_wrong_length": wrong}
    llm.shutdown()
    del llm, core
    return result, tokens


def run(model_dir: str, plan: Plan, device_name: str = "") -> dict:
    from transformers import AutoModelForCausalLM

    dev = plan.device
    reqs = nano_vllm_workload(plan.num_requests, plan.prompt_len, plan.output_len, plan.max_token_id)
    out = {"workload": {"requests": len(reqs), "prompt_tokens": sum(len(p) for p, _ in reqs),
                        "output_tokens": sum(m for _, m in reqs), "prompt_len": list(plan.prompt_len),
                        "output_len": list(plan.output_len), "max_token_id": plan.max_token_id,
                        "sampling": "greedy, ignore_eos"},
           "engine_args": engine_args(plan)}
    out["engine"], tokens = _engine_run(model_dir, plan, reqs, device_name)
    free_device_memory(dev)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev).eval()
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
    out["greedy_check"] = greedy_check.check(hf, hf32, reqs, tokens, plan.greedy_requests,
                                             plan.greedy_exact_tokens, dev)
    del hf32
    free_device_memory(dev)

    if plan.hf_batch_sizes:
        hf_baselines.static_batches(hf, [(p[:16], 4) for p, _ in reqs[:2]], 2, 0.0, dev)  # warm-up
    out["hf_static"] = [hf_baselines.static_batches(hf, reqs, bs, plan.hf_budget_s, dev)
                        for bs in plan.hf_batch_sizes]
    free_device_memory(dev)
    try:
        out["hf_continuous"] = ({"status": "skipped: no time budget in this plan"} if plan.hf_continuous_budget_s <= 0
                                else hf_baselines.continuous_batching(hf, reqs, plan.hf_continuous_budget_s, plan.small))
    except Exception as e:  # a transformers version whose API differs: recorded, the rest still counts
        out["hf_continuous"] = {"status": f"error: {type(e).__name__}: {e}"}
    del hf
    free_device_memory(dev)

    ok = [r for r in out["hf_static"] if r["status"] == "ok"]
    best = max(ok, key=lambda r: r["tok_per_s"]) if ok else None
    out["best_hf_static"] = best
    out["engine_over_best_hf_static"] = out["engine"]["tok_per_s"] / best["tok_per_s"] if best else None
    return out

