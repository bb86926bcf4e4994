"""The fused-MoE Triton kernel against the reference loop over experts, batch by batch.

vLLM counterpart: `benchmarks/kernels/benchmark_moe.py` (the fused-MoE
kernel's timing by batch size).

Qwen3-30B-A3B's experts (hidden 2,048, expert intermediate 768, 128 experts,
top-8; `--small`: 32, 16, 8, top-2), bf16, routed by the softmax top-k of
random router logits, renormalised. For each batch of the plan: the kernel's
output is checked against `fused_experts_reference` first (max abs error
against the dtype's tolerance), then both are timed as a layer calls them
(argument checks included; the reference's per-expert `nonzero` reads back
to the host, which is part of what the kernel removes) with CUDA events over
`moe_iters` calls after a warm-up. Reported: microseconds per call, the ratio
reference / Triton and the tokens per busy expert.
"""
from __future__ import annotations

import torch

from gpu_check_parts.attention_bw import _time
from gpu_check_parts.plan import Plan

TOLERANCE = 3e-2  # bf16: max abs error relative to max(1, |reference|)


def case(batch: int, shape, device: str, gen: torch.Generator):
    from mini_vllm.models.fused_moe import fused_topk_reference

    hidden, inter, experts, top_k = shape
    x = torch.randn(batch, hidden, generator=gen).to(device, torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(device, torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(device, torch.bfloat16)
    weights, ids = fused_topk_reference(torch.randn(batch, experts, generator=gen).to(device), top_k,
                                        renormalize=True)
    return x, w13, w2, weights, ids


def run(plan: Plan) -> dict:
    from mini_vllm.kernels.fused_moe import fused_experts_triton
    from mini_vllm.models.fused_moe import fused_experts_reference

    dev, gen = plan.device, torch.Generator().manual_seed(0)
    rows = []
    for batch in plan.moe_batches:
        args = case(batch, plan.moe_shape, dev, gen)
        want = fused_experts_reference(*args).float()
        got = fused_experts_triton(*args).float()
        err = (got - want).abs().max().item()
        tol = TOLERANCE * max(1.0, want.abs().max().item())
        ref_s = _time(lambda: fused_experts_reference(*args), plan.moe_iters, dev)
        tri_s = _time(lambda: fused_experts_triton(*args), plan.moe_iters, dev)
        rows.append({"batch": batch, "max_abs_err": err, "tolerance": tol, "ok": err <= tol,
                     "tokens_per_busy_expert": batch * plan.moe_shape[3] / args[4].unique().numel(),
                     "reference_us": ref_s * 1e6, "triton_us": tri_s * 1e6, "reference_over_triton": ref_s / tri_s})
        del args, want, got
    hidden, inter, experts, top_k = plan.moe_shape
    at_goal = next((r for r in rows if r["batch"] == plan.moe_goal_batch), None)
    return {"shape": {"hidden": hidden, "intermediate": inter, "experts": experts, "top_k": top_k},
            "dtype": "bfloat16", "rows": rows, "ok": all(r["ok"] for r in rows), "goal_batch": plan.moe_goal_batch,
            "reference_over_triton_at_goal": at_goal["reference_over_triton"] if at_goal else None}
