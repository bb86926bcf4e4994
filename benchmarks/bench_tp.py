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
from collections import Counter
from contextlib import contextmanager

import torch

from mini_vllm import LLM, SamplingParams
from mini_vllm.distributed import COMM_CALLS, COMM_STATS
from mini_vllm.course.tiny_models import model_path


@contextmanager
def timed_collectives():
    """Seconds rank 0 spends inside each collective, waiting for the slowest rank included
    (wraps the names the layers and the executor call; restored on exit)."""
    import mini_vllm.models.layers as lay
    import mini_vllm.models.linear as lin
    import mini_vllm.executor.multiproc_executor as mpe

    spent: Counter = Counter()
    sites = [(lin, "tensor_model_parallel_all_reduce", "all_reduce"),
             (lay, "tensor_model_parallel_all_reduce", "all_reduce"),
             (lay, "tensor_model_parallel_all_gather", "all_gather"),
             (mpe, "broadcast_object", "broadcast_object")]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in sites]
    for (mod, name, key), (_, _, fn) in zip(sites, saved):
        def timed(*a, _fn=fn, _key=key, **k):
            t = time.perf_counter()
            out = _fn(*a, **k)
            spent[_key] += time.perf_counter() - t
            return out
        setattr(mod, name, timed)
    try:
        yield spent
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def all_reduce_latency(worker, numel: int, iters: int) -> float:
    """Mean seconds per all-reduce of `numel` floats with every rank doing nothing else
    (run on all ranks at once through `collective_rpc`): the pure collective cost."""
    from mini_vllm.distributed import tensor_model_parallel_all_reduce

    x = torch.ones(1, numel)
    for _ in range(10):  # warm-up: the first calls set up buffers
        tensor_model_parallel_all_reduce(x.clone(), worker.tp_group)
    t = time.perf_counter()
    for _ in range(iters):
        tensor_model_parallel_all_reduce(x.clone(), worker.tp_group)
    return (time.perf_counter() - t) / iters


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
    core, n_steps = llm.llm_engine.engine_core.engine_core, [0]
    core_step = core.step

    def counted_step():
        n_steps[0] += 1
        return core_step()
    core.step = counted_step
    with timed_collectives() as spent:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
    stats, calls = dict(COMM_STATS), dict(COMM_CALLS)
    idle_us = 0.0
    if tp > 1:  # one decode token's all-reduce (hidden floats), and a 64-token prefill chunk's
        ex = llm.llm_engine.engine_core.engine_core.executor
        idle_us = [1e6 * max(ex.collective_rpc(all_reduce_latency, cfg["hidden_size"] * t, 200))
                   for t in (1, 64)]
    procs = list(getattr(llm.llm_engine.engine_core.engine_core.executor, "procs", []))
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
        "steps": n_steps[0],
        "allreduce_per_step": calls.get("all_reduce", 0) / n_steps[0],
        "collective_s": dict(spent),  # rank 0's time inside collectives
        "collective_frac": sum(spent.values()) / wall,
        "us_per_allreduce": 1e6 * spent.get("all_reduce", 0) / max(1, calls.get("all_reduce", 0)),
        "us_per_idle_allreduce": idle_us or [0.0, 0.0],  # [1 token, 64 tokens], ranks otherwise idle
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
          f"{'same tokens':>11} {'in collectives':>14} {'us/all-reduce':>13} {'idle us (1, 64 tok)':>19}")
    for r in rows:
        print(f"{r['tp']:>3} {r['init_s']:>7.1f} {r['wall_s']:>7.2f} {r['out_tok_s']:>9.1f} "
              f"{rows[0]['wall_s'] / r['wall_s']:>7.2f} {r['allreduce_B_per_tok']:>9.0f} "
              f"{r['allreduce_formula']:>8} {r['gather_B_per_sampled']:>9.0f} {r['gather_formula']:>8} "
              f"{r['allreduce_per_step']:>7.0f} {r['broadcast_B'] / max(1, r['steps']):>12.0f} "
              f"{str(r['tokens'] == rows[0]['tokens']):>11} {r['collective_frac']:>14.0%} "
              f"{r['us_per_allreduce']:>13.0f} "
              f"{'%.0f, %.0f' % tuple(r['us_per_idle_allreduce']):>19}")


if __name__ == "__main__":
    main()
