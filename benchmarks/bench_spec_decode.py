"""Speculative decoding in the engine: wall-clock speed-up over no speculation, same tokens.

Two workloads on the tiny target (CPU, greedy, fp32):
* n-gram on code editing: each prompt holds a stdlib function, then a marker
  and the function's first line again, so the continuation reproduces code
  that is already in the context (what prompt lookup is for). Goal >= 1.8x.
* draft model (tiny-py-draft) on plain stdlib prompts: reports the measured
  acceptance rate alpha and the speed-up that Chapter 4's model predicts,
      speed-up = (1 - alpha^(k+1)) / ((1 - alpha) (1 + k c)),
  with c the measured cost of one draft step relative to one target step.
Batch 1 and batch 8; every configuration's tokens are checked against the
run without speculation before its time is reported.

Run: .venv/bin/python benchmarks/bench_spec_decode.py [--threads 1]
"""
from __future__ import annotations

import argparse
import re
import sysconfig
import time
from pathlib import Path

import torch

from engine_workloads import sample_requests
from mini_vllm import LLM, SamplingParams
from mini_vllm.tiny_models import load_tiny_tokenizer, model_path

TARGET, DRAFT = str(model_path("tiny-py-target")), str(model_path("tiny-py-draft"))


def editing_prompts(n: int, tok) -> list[list[int]]:
    """Functions of 8-30 lines from the stdlib, followed by their first line again."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r"\n(def [^\n]+\n(?:    [^\n]*\n|\n){8,30})", text):
            body = m.group(1)
            ids = tok(body + "\n# unchanged copy:\n" + body.split("\n")[0] + "\n", verbose=False)["input_ids"]
            if 80 <= len(ids) <= 600:
                out.append(ids)
            if len(out) == n:
                return out
    return out


def run(prompts, max_tokens, spec=None, trials: int = 3):
    """Best of `trials` runs (the machine is shared); prefix caching off so that
    later runs do not skip the prompts."""
    llm = LLM(TARGET, dtype="float32", kv_cache_memory_bytes=64 << 20, speculative_config=spec,
              enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)  # warm-up
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    stats = llm.llm_engine.engine_core.spec_decoding_stats()
    return best, [o.outputs[0].token_ids for o in outs], stats


def step_cost(path: str, batch: int, ctx: int = 256, steps: int = 20) -> float:
    """Seconds per decode step of `batch` sequences at context `ctx`."""
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i] * ctx} for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    return best / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tiny_tokenizer()
    edit = editing_prompts(8, tok)
    plain = [p for p, _ in sample_requests(8, (64, 256), (1, 1), seed=4)]
    cost_ratio = {b: step_cost(DRAFT, b) / step_cost(TARGET, b) for b in (1, 8)}
    print(f"draft/target decode step cost c: batch 1 {cost_ratio[1]:.2f}, batch 8 {cost_ratio[8]:.2f}\n")
    print(f"{'workload':<24}{'method':<14}{'k':>3}{'batch':>6}{'alpha':>7}{'speed-up':>10}{'predicted':>11}")
    for name, prompts, method, k in (("code editing", edit, "ngram", 4), ("code editing", edit, "ngram", 8),
                                     ("stdlib prompts", plain, "draft_model", 2),
                                     ("stdlib prompts", plain, "draft_model", 4)):
        spec = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                 "prompt_lookup_max": 4} if method == "ngram" else
                {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": k})
        for batch in (1, 8):
            ps = prompts[:batch]
            t0, base, _ = run(ps, args.max_tokens)
            t1, got, st = run(ps, args.max_tokens, spec)
            if got != base:
                raise SystemExit(f"{method} k={k} batch={batch}: tokens differ from no speculation")
            a = st["acceptance_rate"]
            pred = ""
            if method == "draft_model" and a < 1:
                c = cost_ratio[batch]
                pred = f"{(1 - a ** (k + 1)) / ((1 - a) * (1 + k * c)):.2f}x"
            print(f"{name:<24}{method:<14}{k:>3}{batch:>6}{a:>7.2f}{t0 / t1:>9.2f}x{pred:>11}")


if __name__ == "__main__":
    main()
