"""Seed 001 §2's claim, measured: a mixture of experts needs far larger batches than a dense
model before a decode step stops being bound by reading weights.

Two random checkpoints (`moe_checkpoints.py`, fp32, CPU-sized so the run takes minutes on
2 cores): "moe-bench" (hidden 256, 4 layers, 32 experts of width 256, top-4) and its dense
twin (the same attention, one MLP of width 4 * 256 = 1024): equal active parameters per
token. For each batch b, b sequences of CONTEXT tokens are prefilled into a paged cache,
then one decode step of b tokens (one per sequence) is timed (median of REPEATS, the
model's forward only, the same cores and threads for both models).

Printed per batch: the mean tokens per expert, b * k / E, and the experts the step's
routing touched (summed over the sparse layers, of 4 * 32); each model's step time, its time
per token, and the weight bytes the step had to read divided by its time (GB/s, against the
machine's measured read bandwidth). A step is read bound while its time is about the time
to read its weights: the dense model reads the same bytes at every b; the MoE model reads
k experts per layer at b = 1 and all E of them from b ~ E/k on, each seeing only b * k / E
tokens. The summary line gives, for each model, the largest b whose step still costs
< BOUND (1.5) times its b = 1 step: the same rule for both models.

The engine's experts run through `dispatch.fused_experts` (printed: the reference loop on
a CPU until the CPU path lands; its per-expert Python overhead is part of the MoE time).
Run: flock /tmp/bench.lock .venv/bin/python benchmarks/bench_moe_batch.py [--threads 1]
     [--batches 1,2,4,...]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from machine import machine_line, read_bandwidth
from moe_checkpoints import MOE_KINDS, dense_twin, moe_checkpoint
from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.forward_context import set_forward_context
from mini_vllm.models import load_model
from mini_vllm.models.fused_moe import dispatch
from mini_vllm.paged_attention import allocate_kv_cache
from vllm_side import pin

KIND, CONTEXT, BLOCK, REPEATS = "moe-bench", 16, 16, 7
BOUND = 1.5  # a step is still read bound while it costs < 1.5x its batch-1 time


def _metadata(q_lens, s_lens, tables, block):
    slots, cu = [], [0]
    for table, q, s in zip(tables, q_lens, s_lens):
        slots += [table[p // block] * block + p % block for p in range(s - q, s)]
        cu.append(cu[-1] + q)
    return AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
                             cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                             seq_lens=torch.tensor(s_lens, dtype=torch.int32), max_query_len=max(q_lens),
                             max_seq_len=max(s_lens), query_lens_cpu=list(q_lens), seq_lens_cpu=list(s_lens))


def decode_step_s(model, config, b: int, touched: list | None = None) -> float:
    """Median seconds of one decode step of b sequences with CONTEXT cached tokens each."""
    per_seq = (CONTEXT + 1 + BLOCK - 1) // BLOCK
    for layer in model.attention_layers():
        layer.kv_cache = allocate_kv_cache(b * per_seq, BLOCK, config.num_key_value_heads, config.head_dim)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
    g = torch.Generator().manual_seed(b)
    ids = torch.randint(2, config.vocab_size, (b, CONTEXT + 1), generator=g)
    with torch.no_grad():
        with set_forward_context(_metadata([CONTEXT] * b, [CONTEXT] * b, tables, BLOCK)):
            model(ids[:, :CONTEXT].reshape(-1), torch.arange(CONTEXT).repeat(b))
        times = []
        for _ in range(REPEATS):
            md = _metadata([1] * b, [CONTEXT + 1] * b, tables, BLOCK)
            t = time.perf_counter()
            with set_forward_context(md):
                model(ids[:, CONTEXT], torch.full((b,), CONTEXT))
            times.append(time.perf_counter() - t)
    return statistics.median(times)


class Router:
    """Counts the distinct experts each sparse layer's routing picks in the last forward."""

    def __init__(self, model):
        self.counts: dict[int, int] = {}
        for i, moe in enumerate(model.moe_layers()):
            moe.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, args, out):
            _, ids = module.select_experts(args[1])
            self.counts[i] = int(torch.unique(ids).numel())
        return hook


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    args = ap.parse_args(argv)
    print(machine_line([args.threads]), flush=True)
    pin(args.threads)
    bw = read_bandwidth(args.threads)
    cfg = MOE_KINDS[KIND]
    e, k, layers = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]
    print(f"engine experts: {dispatch.select_impl(torch.zeros(1))}; {args.threads} thread(s); context {CONTEXT}; "
          f"median of {REPEATS} decode steps", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        moe, mcfg = load_model(moe_checkpoint(Path(tmp), KIND))
        dense, dcfg = load_model(dense_twin(Path(tmp), KIND))
    expert_bytes = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 4
    other_bytes = sum(p.numel() * 4 for n, p in moe.named_parameters() if "experts" not in n and "embed" not in n)
    dense_bytes = sum(p.numel() * 4 for n, p in dense.named_parameters() if "embed" not in n)
    router = Router(moe)
    print(f"weights read per step: dense {dense_bytes / 1e6:.1f} MB; MoE {other_bytes / 1e6:.1f} MB + "
          f"{expert_bytes / 1e6:.2f} MB per touched expert (all {layers * e}: {layers * e * expert_bytes / 1e6:.0f} MB); "
          f"read bandwidth {bw:.1f} GB/s")
    print("| batch | tokens/expert b*k/E | experts touched | MoE ms | dense ms | MoE/dense | MoE GB/s | dense GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        t_moe = decode_step_s(moe, mcfg, b)
        touched = sum(router.counts.values())
        t_dense = decode_step_s(dense, dcfg, b)
        moe_gbs = (other_bytes + touched * expert_bytes) / t_moe / 1e9
        rows.append((b, t_moe, t_dense))
        print(f"| {b} | {b * k / e:.2f} | {touched} / {layers * e} | {t_moe * 1e3:.2f} | {t_dense * 1e3:.2f} | "
              f"{t_moe / t_dense:.2f}x | {moe_gbs:.1f} | {dense_bytes / t_dense / 1e9:.1f} |", flush=True)
    for name, col in (("MoE", 1), ("dense", 2)):
        base = rows[0][col]
        bound = [r[0] for r in rows if r[col] < BOUND * base]
        print(f"{name}: the step costs < {BOUND}x its batch-{rows[0][0]} time up to batch {max(bound)} "
              f"(time per token there: {rows[[r[0] for r in rows].index(max(bound))][col] / max(bound) * 1e3:.3f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
