"""Engine output throughput against Hugging Face `generate` on the tiny target (CPU).

Workload: 256 requests, prompts cut from the standard library with 16-512
tokens, 16-256 output tokens each with ignore_eos, fixed seed. HF runs static
batches of size 1, 8 and 32 (left padded; a batch runs until its longest
request is done, as static batching does) and the best one is the baseline.
Before timing, greedy tokens of the engine and of HF (batch 1, unpadded) are
compared on the first requests. Also reported: the same engine with
max_num_seqs=1 (no batching), which isolates what continuous batching buys.
Goal: engine >= 3x the best HF static batch.

The run also prints how much *work* each static batch size does per unit of
useful work (padded tokens through the linear layers, query-key pairs in
prefill, keys read per decoded token): at equal speed per unit of work, these
ratios bound what continuous batching alone can gain over static batching.

Run: .venv/bin/python benchmarks/bench_engine_throughput.py [--num-requests 256] [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import torch

from engine_workloads import sample_requests
from mini_vllm import LLM, SamplingParams
from mini_vllm.tiny_models import load_tiny_model, model_path

GOAL = 3.0


def engine_run(reqs, **kw) -> tuple[float, list[list[int]]]:
    llm = LLM(str(model_path("tiny-py-target")), dtype="float32", block_size=16,
              kv_cache_memory_bytes=256 << 20, **kw)
    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    t = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def hf_run(hf, reqs, batch_size: int) -> float:
    t = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i:i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), 1, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):  # left padding, as HF decoder-only generation needs
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        n = max(m for _, m in chunk)
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    top_k=None, top_p=None, temperature=None, pad_token_id=1)
    return time.perf_counter() - t


@torch.inference_mode()
def check_greedy(hf, reqs, engine_tokens, k: int = 6) -> None:
    for (p, m), got in list(zip(reqs, engine_tokens))[:k]:
        ids = torch.tensor([p])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m,
                           do_sample=False, top_k=None, top_p=None, temperature=None,
                           pad_token_id=1)[0, len(p):].tolist()
        if want != got:
            raise SystemExit(f"greedy tokens differ from HF for a {len(p)}-token prompt: not timing")


def padding_work(reqs, batch_size: int) -> tuple[float, float, float]:
    """(linear tokens, prefill query-key pairs, decode key reads) that static
    batches of `batch_size` process, each divided by the useful amount."""
    lin = pre = dec = 0
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i:i + batch_size]
        width, n = max(len(p) for p, _ in chunk), max(m for _, m in chunk)
        lin += len(chunk) * (width + n)
        pre += len(chunk) * width * width
        dec += len(chunk) * (n * width + n * (n - 1) // 2)
    useful_lin = sum(len(p) + m for p, m in reqs)
    useful_pre = sum(len(p) ** 2 for p, _ in reqs)
    useful_dec = sum(m * len(p) + m * (m - 1) // 2 for p, m in reqs)
    return lin / useful_lin, pre / useful_pre, dec / useful_dec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hf-batch-sizes", default="1,8,32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reqs = sample_requests(args.num_requests, (16, 512), (16, 256), seed=0)
    useful = sum(m for _, m in reqs)
    print(f"{len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, {useful} output tokens, "
          f"{args.threads} thread(s)")
    for bs in (int(x) for x in args.hf_batch_sizes.split(",")):
        lin, pre, dec = padding_work(reqs, bs)
        print(f"static batch {bs:>2} does {lin:.2f}x the useful linear-layer tokens, {pre:.2f}x the prefill "
              f"query-key pairs, {dec:.2f}x the decode key reads")
    hf = load_tiny_model("tiny-py-target", dtype=torch.float32)
    t_eng, toks = engine_run(reqs, max_num_seqs=128)
    check_greedy(hf, reqs, toks)
    print("greedy tokens of the first requests match HF generate: timing")
    rows = [("mini-vLLM engine (max_num_seqs=128)", t_eng)]
    t_one, _ = engine_run(reqs, max_num_seqs=1)
    rows.append(("mini-vLLM engine (max_num_seqs=1)", t_one))
    best = None
    for bs in (int(x) for x in args.hf_batch_sizes.split(",")):
        t = hf_run(hf, reqs, bs)
        rows.append((f"HF generate, static batch {bs}", t))
        best = t if best is None else min(best, t)
    for name, t in rows:
        print(f"{name:<40} {t:8.1f} s  {useful / t:8.1f} output tok/s")
    ratio = best / t_eng
    print(f"\nengine / best HF static batch: {ratio:.2f}x (goal >= {GOAL}x)  "
          f"{'MET' if ratio >= GOAL else 'NOT MET'}")
    print(f"engine / engine with max_num_seqs=1: {t_one / t_eng:.2f}x")


if __name__ == "__main__":
    main()
