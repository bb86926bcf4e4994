"""The floor of nano-vllm's workload on a GPU, from the engine's own schedule, computed on any CPU.

No vLLM counterpart. Drives the engine's scheduler without a model
(`gpu_check_parts.roofline.model_free_schedule`) over the workload `make
gpu-check` times (256 sequences, Qwen3-0.6B shape, bf16), with the KV pool
the engine had on the GPU, and prints what the run must move and compute and
the floor that follows at a given copy bandwidth and dense peak (defaults:
the H100 of benchmarks/gpu_reports/2026-11-27-h100, copy 3.02 TB/s measured,
989 TFLOP/s published). The GPU run (`make gpu-check`) prints the same
accounting for the schedule it actually ran, with its own measured bandwidth.

Run: python benchmarks/bench_roofline_floor.py [--copy-bw 3.02e12] [--peak 989.4e12] [--num-blocks 39148]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_parts import roofline  # noqa: E402
from gpu_check_parts.checkpoint import QWEN3_0_6B  # noqa: E402
from gpu_check_parts.plan import Plan  # noqa: E402
from gpu_check_parts.throughput import nano_vllm_workload  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copy-bw", type=float, default=3.017e12, help="bytes/s (H100, measured 2026-11-27)")
    ap.add_argument("--peak", type=float, default=989.4e12, help="dense bf16 FLOP/s (H100 SXM, published)")
    ap.add_argument("--num-blocks", type=int, default=39148, help="KV blocks of 16 tokens (the H100 run's pool)")
    args = ap.parse_args(argv)
    plan = Plan(device="cuda", small=False)
    reqs = nano_vllm_workload(plan.num_requests, plan.prompt_len, plan.output_len, plan.max_token_id)
    steps = roofline.model_free_schedule(reqs, args.num_blocks, plan.block_size, plan.max_num_seqs,
                                         plan.max_num_batched_tokens, plan.max_model_len)
    cost = roofline.ModelCost.from_config(QWEN3_0_6B, dtype_bytes=2)
    # floor only: each step "lasts" one time unit, so wall figures are not meaningful here
    r = roofline.account(cost, steps, float(len(steps)), args.copy_bw, args.peak)
    out_tokens = sum(m for _, m in reqs)
    t = r["totals"]
    print(f"nano-vllm's workload: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt and {out_tokens} "
          f"output tokens; {r['steps']} engine steps with {args.num_blocks} KV blocks")
    print(f"bytes: {t['bytes'] / 1e12:.2f} TB (weights {t['weights'] / 1e12:.2f}, KV read {t['kv_read'] / 1e12:.2f}, "
          f"KV written {t['kv_write'] / 1e12:.3f}, logits {t['logits'] / 1e12:.3f}); FLOPs {t['flops'] / 1e15:.1f} P")
    for name, ph in r["phases"].items():
        print(f"  {name:8s} {ph['steps']:5d} steps, {ph['tokens']:7d} tokens, floor {ph['floor_s']:.2f} s")
    print(f"floor at {args.copy_bw:.3g} B/s and {args.peak:.3g} FLOP/s: {r['floor_s']:.2f} s = "
          f"{out_tokens / r['floor_s']:,.0f} output tok/s at most")
    return 0


if __name__ == "__main__":
    sys.exit(main())
