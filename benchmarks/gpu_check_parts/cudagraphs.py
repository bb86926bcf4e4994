"""Eager vs CUDA graphs (FULL, PIECEWISE, FULL_AND_PIECEWISE): step times and tokens.

vLLM counterpart: `benchmarks/benchmark_latency.py` run with and without
`--enforce-eager`, and seed 001's Figure 4.6 (PIECEWISE vs FULL vs eager at
batch 1, 8, 64). Each mode gets its own engine on the same checkpoint, in one
process, one after the other:

* start-up: seconds to build the engine (compilation and capture included);
* the decode step profile of `step_profile.py` (wall vs device-busy time)
  at the plan's batch sizes;
* tokens: a short greedy workload, compared token for token with the eager
  engine's (the oracle). FULL must match it exactly (the same kernels on
  padded inputs; a verdict of the report). The compiled modes round bf16
  differently where inductor fuses operations, so for them the number of
  identical requests and the first divergences are reported.
"""
from __future__ import annotations

import time

from gpu_check_parts.plan import Plan, engine_args
from gpu_check_parts.step_profile import _profile_batch
from gpu_check_parts.throughput import nano_vllm_workload

MODES = [("eager", {"enforce_eager": True}),
         ("FULL", {"compilation_config": {"cudagraph_mode": "FULL"}}),
         ("PIECEWISE", {"compilation_config": {"mode": 3, "cudagraph_mode": "PIECEWISE"}}),
         ("FULL_AND_PIECEWISE", {"compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}})]


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run(model_dir: str, plan: Plan, vocab: int, modes=MODES) -> dict:
    from mini_vllm import LLM, SamplingParams

    n = 4 if plan.small else 32
    reqs = nano_vllm_workload(n, (8, 24) if plan.small else (16, 512), (4, 8) if plan.small else (32, 128),
                              min(plan.max_token_id, vocab - 1), seed=1)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
    rows, eager_tokens = [], None
    for name, kw in modes:
        start = time.perf_counter()
        try:
            llm = LLM(model_dir, **engine_args(plan, kv_cache_memory_bytes=plan.graph_kv_bytes, **kw))
        except Exception as e:  # recorded; the other modes still run
            rows.append({"mode": name, "status": f"error: {type(e).__name__}: {e}"[:400]})
            continue
        startup = time.perf_counter() - start
        mf = llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner.model_forward
        row = {"mode": name, "status": "ok", "startup_s": startup, "capture_s": mf.capture_seconds,
               "capture_sizes": len(mf.config.cudagraph_capture_sizes) if mf.pool is not None else 0}
        try:
            row["profile"] = [_profile_batch(llm.llm_engine, b, plan, vocab) for b in plan.profile_batches]
            row["last_step_mode"] = mf.last_mode.name
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
            row["workload_s"] = time.perf_counter() - t
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            row["output_tokens"] = sum(len(x) for x in tokens)
            if eager_tokens is None:
                eager_tokens = tokens
            else:
                div = [_first_divergence(a, b) for a, b in zip(eager_tokens, tokens)]
                row["requests_identical_to_eager"] = sum(d is None for d in div)
                row["first_divergences"] = [(i, d) for i, d in enumerate(div) if d is not None][:8]
        except Exception as e:
            row["status"] = f"error: {type(e).__name__}: {e}"[:400]
        llm.shutdown()
        del llm, mf
        rows.append(row)
    by = {r["mode"]: r for r in rows if r.get("status") == "ok" and "profile" in r}
    batch1 = {m: r["profile"][0] for m, r in by.items() if r["profile"][0]["batch"] == 1}
    return {"requests": n, "rows": rows,
            "batch1_wall_over_busy": {m: p["wall_over_busy"] for m, p in batch1.items()},
            # FULL replays the eager kernels on padded inputs: its tokens must be the eager ones. The
            # compiled modes fuse operations (another bf16 rounding): their agreement is reported only.
            "full_identical": by.get("FULL", {}).get("requests_identical_to_eager") == n}
