"""Tensor parallelism on this machine: wall time of TP = 1/2/4 and the bytes communicated per token.

The workload: N requests of P prompt tokens, M greedy output tokens each, on the
tiny target, prefix caching off (so every token is forwarded exactly once).
Bytes are what rank 0 contributes to each collective (`COMM_STATS`), set
beside the formula: per forwarded token, 2 all-reduces per layer (after o_proj
and down_proj) plus one for the vocab-parallel embedding, each hidden_size
floats; per sampled token one all-gather of vocab/tp logits.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_tp.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from mini_vllm import LLM, SamplingParams
from mini_vllm.distributed import COMM_CALLS, COMM_STATS
from mini_vllm.tiny_models import model_path


def run_tp(tp: int, n: int = 8, prompt_len: int = 64, max_tokens: int = 32) -> dict:
    path = model_path("tiny-py-target")
    cfg = json.loads((path / "config.json").read_text())
    t0 = time.perf_counter()
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20,
              enable_prefix_caching=False, tensor_parallel_size=tp)
    t_init = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, cfg["vocab_size"], (prompt_len,), generator=g).tolist()}
               for _ in range(n)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    COMM_STATS.clear()
    COMM_CALLS.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats, calls = dict(COMM_STATS), dict(COMM_CALLS)
    procs = list(getattr(llm.llm_engine.engine_core.executor, "procs", []))
    llm.shutdown()
    forwarded = n * prompt_len + n * (max_tokens - 1)  # the last sampled token is never fed back
    sampled = n * max_tokens
    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    return {
        "tp": tp, "init_s": t_init, "wall_s": wall,
        "out_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "worker_exitcodes": [p.exitcode for p in procs],  # 0 each: a clean shutdown
        "allreduce_B_per_tok": stats.get("all_reduce", 0) / forwarded,
        "allreduce_formula": 0 if tp == 1 else (2 * L + 1) * H * 4,
        "gather_B_per_sampled": stats.get("all_gather", 0) / sampled,
        "gather_formula": 0 if tp == 1 else -(-V // tp) * 4,
        "broadcast_B": stats.get("broadcast_object", 0),
        "steps": calls.get("broadcast_object", 0),  # one broadcast per engine step
        "allreduce_per_step": calls.get("all_reduce", 0) / max(1, calls.get("broadcast_object", 0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="TP = 1 and 2 only, a smaller workload")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tps = (1, 2) if args.quick else (1, 2, 4)
    kw = dict(n=4, max_tokens=16) if args.quick else {}
    rows = [run_tp(tp, **kw) for tp in tps]
    print(f"{'tp':>3} {'init s':>7} {'gen s':>7} {'out tok/s':>9} {'x TP=1':>7} {'AR B/tok':>9} "
          f"{'formula':>8} {'AG B/tok':>9} {'formula':>8} {'AR/step':>7} {'bcast B/step':>12} "
          f"{'same tokens':>11}")
    for r in rows:
        print(f"{r['tp']:>3} {r['init_s']:>7.1f} {r['wall_s']:>7.2f} {r['out_tok_s']:>9.1f} "
              f"{rows[0]['wall_s'] / r['wall_s']:>7.2f} {r['allreduce_B_per_tok']:>9.0f} "
              f"{r['allreduce_formula']:>8} {r['gather_B_per_sampled']:>9.0f} {r['gather_formula']:>8} "
              f"{r['allreduce_per_step']:>7.0f} {r['broadcast_B'] / max(1, r['steps']):>12.0f} "
              f"{str(r['tokens'] == rows[0]['tokens']):>11}")


if __name__ == "__main__":
    main()
