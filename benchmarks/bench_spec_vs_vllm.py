"""Speculative decoding side by side with real vLLM: the course's EAGLE head, the draft model
and n-gram lookup, in both engines, on held-out code (CPU, greedy, fp32).

1. Acceptance: mean acceptance length (1 + accepted / drafts, vLLM's definition) of the
   EAGLE head (`models/tiny-py-eagle`) at k = 1..5, over ACCEPT_PROMPTS held-out prompts
   (the first 64 tokens of held-out standard-library files) continued for 96 tokens, in
   the engine and in vLLM 0.32 running the same head.
2. Speed: output tok/s at batch 1, 8 and 32 (that many requests at once, 128 tokens each)
   without speculation and with EAGLE (k = --k), the draft model (k = 3) and n-gram lookup
   (k = 3, prompt_lookup 2..4), in the engine and in vLLM. Each configuration's tokens are
   compared with the run without speculation before its time counts; vLLM's with its own.
   Best of --runs runs. `--methods` picks the rows (the run without speculation is always
   there: the speed-ups divide by it). With EAGLE chosen, a last row runs the engine's
   default, the batch-size schedule it measures at start-up ("measured"; vLLM has none).

Equal settings for both engines: block size 32, 64 MiB of KV cache, max_num_seqs 32,
prefix caching off (each run repeats the same prompts), the same pinned cores. vLLM runs
eagerly in its own process per configuration (one start-up each). The first line printed
is the machine: every ratio holds for that CPU only.

Run: .venv/bin/python benchmarks/bench_spec_vs_vllm.py [--threads 1,2] [--runs 2] [--k 3]
     [--methods eagle,draft_model,ngram] [--batches 1,8,32] [--skip-acceptance] [--skip-speed]
"""
from __future__ import annotations

import argparse
import json
import time

from machine import machine_line
from mini_vllm import LLM, SamplingParams
from mini_vllm.course.tiny_models import corpus_files, load_tiny_tokenizer, model_path
from vllm_side import MISSING, pin, request, run_vllm, vllm_python

TARGET, DRAFT, EAGLE = (str(model_path(n)) for n in ("tiny-py-target", "tiny-py-draft", "tiny-py-eagle"))
SETTINGS = dict(block_size=32, kv_cache_memory_bytes=64 << 20, max_num_seqs=32, enable_prefix_caching=False)
ACCEPT_PROMPTS, ACCEPT_TOKENS, SPEED_TOKENS = 48, 96, 128


def held_out_prompts(n: int, length: int = 64) -> list[list[int]]:
    tok = load_tiny_tokenizer()
    out = []
    for path in corpus_files("val"):
        ids = tok(path.read_text(encoding="utf-8", errors="replace"), verbose=False)["input_ids"]
        for start in range(0, len(ids) - length, 997):  # a few windows per file, far apart
            out.append(ids[start:start + length])
            if len(out) == n:
                return out
    return out


def spec_config(method: str | None, k: int, per_batch_size: list | str | None = None) -> dict | None:
    """`per_batch_size`: vLLM's num_speculative_tokens_per_batch_size, given to both engines; None
    (vLLM's default, k at every batch size) is passed explicitly, since the engine's own default
    is "auto", the schedule it measures at start-up, which vLLM lacks."""
    if method is None:
        return None
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    else:
        spec = {"method": method, "model": EAGLE if method == "eagle" else DRAFT, "num_speculative_tokens": k}
    return dict(spec, num_speculative_tokens_per_batch_size=per_batch_size)


def mini_run(prompts, max_tokens: int, spec: dict | None, runs: int) -> tuple[float, list, dict | None]:
    """Best wall time of `runs`, the tokens, and the engine's speculative-decoding stats."""
    llm = LLM(TARGET, dtype="float32", speculative_config=spec, **SETTINGS)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    best, toks = float("inf"), None
    for _ in range(runs):
        t = time.perf_counter()
        outs = llm.generate(inputs, sp, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
        toks = [o.outputs[0].token_ids for o in outs]
    stats = llm.llm_engine.engine_core.call_utility("spec_decoding_stats") if spec else None
    llm.shutdown()
    return best, toks, stats


def vllm_run(prompts, max_tokens: int, spec: dict | None, runs: int, threads: int):
    reqs = [request(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for p in prompts]
    phases = [{"name": "warm-up", "requests": reqs[:1]}] + [{"name": f"run{i}", "requests": reqs}
                                                            for i in range(runs)]
    kw = dict(SETTINGS, enforce_eager=True)
    if spec:
        kw["speculative_config"] = spec
    res = run_vllm(TARGET, phases, threads=threads, **kw)["phases"][1:]
    best = min(p["wall_s"] for p in res)
    toks = [r["outputs"][0]["token_ids"] for r in res[-1]["results"]]
    return best, toks, res[-1].get("spec_decode")


def acceptance_table(threads: int) -> None:
    prompts = held_out_prompts(ACCEPT_PROMPTS)
    print(f"\nEAGLE mean acceptance length, {len(prompts)} held-out prompts x {ACCEPT_TOKENS} tokens "
          f"({threads} thread{'s' * (threads > 1)})")
    print(f"{'k':>3}{'mini-vLLM':>12}{'vLLM 0.32':>12}  per-position acceptance (mini | vLLM)")
    for k in range(1, 6):
        spec = spec_config("eagle", k)
        _, _, st = mini_run(prompts, ACCEPT_TOKENS, spec, runs=1)
        mine = f"{st['mean_acceptance_length']:.3f}"
        theirs, pos_v = "-", ""
        if vllm_python() is not None:
            _, _, sv = vllm_run(prompts, ACCEPT_TOKENS, spec, 1, threads)
            theirs = f"{sv['mean_acceptance_length']:.3f}"
            pos_v = " ".join(f"{a:.2f}" for a in sv["acceptance_rate_per_pos"])
        pos_m = " ".join(f"{a / st['num_draft_sequences']:.2f}" for a in st["accepted_per_position"])
        print(f"{k:>3}{mine:>12}{theirs:>12}  {pos_m} | {pos_v}", flush=True)


def speed_table(threads: int, runs: int, k: int, chosen: list[str], per_batch_size: list | None = None,
                batches: tuple[int, ...] = (1, 8, 32)) -> None:
    prompts = held_out_prompts(32)
    print(f"\nOutput tok/s, {SPEED_TOKENS} tokens per request, best of {runs} ({threads} thread"
          f"{'s' * (threads > 1)}); speed-up over the same engine without speculation in brackets")
    methods = [(None, 0, None)] + [(m, k if m == "eagle" else 3, None) for m in ("eagle", "draft_model", "ngram")
                                   if m in chosen]
    if per_batch_size is not None:  # EAGLE again, with the batch-size schedule of draft lengths
        methods.append(("eagle", k, per_batch_size))
    if "eagle" in chosen:  # and with the engine's default, the measured schedule (the engine only)
        methods.append(("eagle", k, "auto"))
    print(f"{'batch':>6}{'method':>21}{'mini-vLLM':>22}{'vLLM 0.32':>22}{'mini / vLLM':>13}")
    for batch in batches:
        ps = prompts[:batch]
        useful = batch * SPEED_TOKENS
        base = {}
        for method, kk, sched in methods:
            t, toks, _ = mini_run(ps, SPEED_TOKENS, spec_config(method, kk, sched), runs)
            if method is None:
                base["mini"] = (t, toks)
            elif toks != base["mini"][1]:
                raise SystemExit(f"engine {method} batch {batch}: tokens differ from no speculation")
            cell_m = f"{useful / t:8.1f} ({base['mini'][0] / t:.2f}x)"
            cell_v, ratio = "-", ""
            if vllm_python() is not None and sched != "auto":
                tv, toks_v, _ = vllm_run(ps, SPEED_TOKENS, spec_config(method, kk, sched), runs, threads)
                if method is None:
                    base["vllm"] = (tv, toks_v)
                elif toks_v != base["vllm"][1]:
                    raise SystemExit(f"vLLM {method} batch {batch}: tokens differ from its own run without it")
                cell_v = f"{useful / tv:8.1f} ({base['vllm'][0] / tv:.2f}x)"
                ratio = f"{tv / t:.2f}"
            name = "none" if method is None else f"{method} k={kk}" + (
                " measured" if sched == "auto" else " dynamic" if sched else "")
            print(f"{batch:>6}{name:>21}{cell_m:>22}{cell_v:>22}{ratio:>13}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--k", type=int, default=3, help="EAGLE's k in the speed table")
    ap.add_argument("--skip-acceptance", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--methods", default="eagle,draft_model,ngram", help="speed-table rows besides none")
    ap.add_argument("--batches", default="1,8,32", help="speed-table batch sizes (at most 32)")
    ap.add_argument("--per-batch-size", type=json.loads, default=None, metavar="JSON",
                    help="an extra EAGLE row with num_speculative_tokens_per_batch_size, e.g. "
                         "'[[1, 8, 3], [9, 64, 0]]' (both engines)")
    args = ap.parse_args()
    threads = [int(x) for x in args.threads.split(",")]
    print(machine_line(threads))
    if vllm_python() is None:
        print(f"(vLLM columns empty: {MISSING})")
    for n in threads:
        pin(n)
        if not args.skip_acceptance:
            acceptance_table(n)
        if not args.skip_speed:
            speed_table(n, args.runs, args.k, args.methods.split(","), args.per_batch_size,
                        tuple(int(b) for b in args.batches.split(",")))


if __name__ == "__main__":
    main()
