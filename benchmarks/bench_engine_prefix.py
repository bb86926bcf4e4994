"""TTFT of a request whose 768-token prefix is in the prefix cache, against cold, for the
course's engine and (after `make vllm`) for real vLLM side by side.

The tiny target's context is 1,024 tokens: the request is a 768-token prefix
(cut from the standard library) plus a 32-token tail of its own. Warm: a first
request with the same prefix and another tail ran before, so its blocks are
cached; the measured request computes only its tail. Cold: the same request
while the cache holds nothing of its prefix (each trial cuts a prefix of its
own, so one engine instance serves every trial). Best of N. Both engines get
equal settings: block size 32 (vLLM's CPU attention needs a multiple of 32), a
1,024-token step budget, 64 MiB of KV cache, the same pinned cores. vLLM's TTFT
is measured the way the engine's is: from `add_request` to the `step()` that
returns the first token (vllm_runner.py's "steps" mode, engine core in the
driver's process as in the course's engine). Before timing, both
engines' first tokens and prefix hits are checked.
Goal >= 5x warm over cold (seed 000 reports 82 -> 18 ms, 4.5x).

Run: .venv/bin/python benchmarks/bench_engine_prefix.py [--threads 1,2] [--trials 7] [--no-vllm]
"""
from __future__ import annotations

import argparse
import time

from engine_workloads import sample_requests
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.course.tiny_models import model_path
from vllm_side import MISSING, VllmSession, pin, request, vllm_job, vllm_python

GOAL = 5.0
PREFIX, TAIL = 768, 32
SETTINGS = dict(block_size=32, max_num_batched_tokens=1024, kv_cache_memory_bytes=64 << 20)


def trials_prompts(n: int) -> list[tuple[list[int], list[int]]]:
    """Per trial: two prompts sharing a 768-token prefix of their own (seed, measured)."""
    out = []
    for i in range(n):
        (base, _), = sample_requests(1, (PREFIX + 3 * TAIL, PREFIX + 3 * TAIL), (1, 1), seed=100 + i)
        prefix = base[:PREFIX]
        out.append((prefix + base[PREFIX:PREFIX + TAIL], prefix + base[PREFIX + TAIL:PREFIX + 2 * TAIL]))
    return out


def mini_ttft(eng: LLMEngine, prompt: list[int], rid: str) -> tuple[float, int, int]:
    """(TTFT seconds, first token, prompt tokens served from the cache)."""
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    eng.add_request(rid, {"prompt_token_ids": prompt}, sp)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.outputs and out.outputs[0].token_ids:
                first, tok, hit = time.perf_counter() - t, out.outputs[0].token_ids[0], out.num_cached_tokens
    return first, tok, hit


def run_mini(prompts) -> dict:
    eng = LLMEngine.from_engine_args(str(model_path("tiny-py-target")), dtype="float32", **SETTINGS)
    mini_ttft(eng, [5] * 16, "w")  # warm up the process (allocations, first-call costs)
    res = {"cold": [], "warm": [], "tokens": [], "hits": []}
    for i, (seed, measured) in enumerate(prompts):
        c, tok_c, _ = mini_ttft(eng, measured, f"c{i}")  # cold: nothing of this prefix cached yet
        mini_ttft(eng, seed, f"s{i}")  # the prefix is cached now; the measured tail below is new
        w, tok_w, hit = mini_ttft(eng, seed[:PREFIX] + measured[PREFIX:][::-1], f"h{i}")
        res["cold"].append(c)
        res["warm"].append(w)
        res["tokens"] += [tok_c, tok_w]
        res["hits"].append(hit)
    return res


def vllm_phase(name: str, prompt: list[int]) -> dict:
    return {"name": name, "mode": "steps",
            "requests": [request(prompt, max_tokens=1, temperature=0.0, ignore_eos=True)]}


def run_vllm(prompts, threads: int) -> dict:
    res = {"cold": [], "warm": [], "tokens": [], "hits": []}
    job = vllm_job(str(model_path("tiny-py-target")), [], threads=threads, **SETTINGS)
    with VllmSession(job, in_process=True) as vs:  # step() = one engine-core step, as ours
        vs.run(vllm_phase("warm-up", [5] * 16))
        for i, (seed, measured) in enumerate(prompts):
            out = []
            for name, p in (("cold", measured), ("seed", seed),
                            ("warm", seed[:PREFIX] + measured[PREFIX:][::-1])):
                r = vs.run(vllm_phase(name, p))["results"][0]
                out.append((r["token_times_s"][0] - r["added_s"], r["outputs"][0]["token_ids"][0],
                            r["num_cached_tokens"]))
            res["cold"].append(out[0][0])
            res["warm"].append(out[2][0])
            res["tokens"] += [out[0][1], out[2][1]]
            res["hits"].append(out[2][2])
    return res


def report(name: str, r: dict) -> tuple[float, float]:
    c, w = min(r["cold"]), min(r["warm"])
    print(f"  {name:<10} cold {c * 1e3:7.1f} ms   warm {w * 1e3:6.1f} ms   speed-up {c / w:5.2f}x "
          f"(goal >= {GOAL}x: {'MET' if c / w >= GOAL else 'NOT MET'})   min prefix hit {min(r['hits'])} tokens")
    return c, w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1", help="comma-separated thread counts, e.g. 1,2")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    prompts = trials_prompts(args.trials)
    use_vllm = not args.no_vllm and vllm_python() is not None
    if not use_vllm and not args.no_vllm:
        print(f"(no side-by-side run: {MISSING})")
    print(f"TTFT of an {PREFIX + TAIL}-token prompt, best of {args.trials}; both engines: {SETTINGS}")
    for n in (int(x) for x in args.threads.split(",")):
        pin(n)
        print(f"== {n} thread(s)")
        mini = run_mini(prompts)
        assert min(mini["hits"]) >= PREFIX, f"the engine's warm requests hit only {min(mini['hits'])} tokens"
        mc, mw = report("mini-vLLM", mini)
        if use_vllm:
            v = run_vllm(prompts, n)
            if v["tokens"] != mini["tokens"]:
                raise SystemExit(f"first tokens differ from vLLM's ({v['tokens']} vs {mini['tokens']})")
            assert min(v["hits"]) >= PREFIX, f"vLLM's warm requests hit only {min(v['hits'])} tokens"
            vc, vw = report("vLLM", v)
            print(f"  first tokens identical; mini-vLLM / vLLM speed (TTFT ratio): cold {vc / mc:.2f}x, "
                  f"warm {vw / mw:.2f}x")


if __name__ == "__main__":
    main()
