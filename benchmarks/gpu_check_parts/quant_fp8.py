"""FP8 W8A8 linears (`mini_vllm.models.quantization.fp8`) against bf16 on the device.

vLLM counterpart: `benchmarks/kernels/bench_fp8_gemm.py` (FP8 scaled matmuls against bf16).

What only a GPU with FP8 (sm89+: H100, H200) shows: `torch._scaled_mm` on tensor cores, whose
fp32 accumulation order is its own, and what W8A8 costs or saves against a bf16 matmul. For
each of Qwen3-0.6B's linear shapes (`--small`: one tiny shape) and each batch of the plan,
with per-channel weight scales and dynamic per-token activation scales (vLLM's
`fp8_per_channel`): the layer's product (activation quantization, `_scaled_mm`, scales) is
checked first against the dequantized fp32 reference, then both the bf16 `F.linear` and the
FP8 path are timed with CUDA events. Reported: microseconds per call, bf16 / FP8, and whether
`_scaled_mm` ran (a device without FP8 takes the reference path, reported, not hidden).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_check_parts.attention_bw import _time
from gpu_check_parts.plan import Plan

TOLERANCE = 2e-2  # bf16 output: max abs error relative to max(1, |reference|)


def run(plan: Plan) -> dict:
    from mini_vllm.models.quantization import quant_utils as qu
    from mini_vllm.models.quantization.fp8 import fp8_linear_reference, fp8_scaled_mm, scaled_mm_supported

    dev, gen = plan.device, torch.Generator().manual_seed(0)
    native = scaled_mm_supported(torch.device(dev))
    mm = fp8_scaled_mm if native else fp8_linear_reference
    rows = []
    for k, n in plan.fp8_shapes:
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dev, torch.bfloat16)
        w_scale = qu.fp8_weight_scale(w, per_channel=True)
        w_q = qu.quantize_fp8(w, w_scale)
        for batch in plan.fp8_batches:
            x = torch.randn(batch, k, generator=gen).to(dev, torch.bfloat16)

            def fp8():
                x_q, x_scale = qu.quantize_activation_fp8(x, per_token=True)
                return mm(x_q, x_scale, w_q, w_scale, None, torch.bfloat16)

            x_q, x_scale = qu.quantize_activation_fp8(x, per_token=True)
            want = fp8_linear_reference(x_q, x_scale, w_q, w_scale, None, torch.float32)
            err = (fp8().float() - want).abs().max().item()
            tol = TOLERANCE * max(1.0, want.abs().max().item())
            bf16_s = _time(lambda: F.linear(x, w), plan.fp8_iters, dev)
            fp8_s = _time(fp8, plan.fp8_iters, dev)
            rows.append({"shape": [k, n], "batch": batch, "max_abs_err": err, "tolerance": tol, "ok": err <= tol,
                         "bf16_us": bf16_s * 1e6, "fp8_us": fp8_s * 1e6, "bf16_over_fp8": bf16_s / fp8_s})
    return {"scaled_mm": native, "rows": rows, "ok": all(r["ok"] for r in rows)}


def lines(q: dict) -> list[str]:
    if "rows" not in q:
        return []
    out = ["", "## FP8 W8A8 linears (fp8_per_channel)", "",
           f"`torch._scaled_mm` ran: {'yes' if q['scaled_mm'] else 'no (the dequantized reference path)'}; each "
           "product checked against the dequantized fp32 reference first.", "",
           "| K x N | batch | bf16 us | FP8 us (quantize + matmul + scales) | bf16 / FP8 | max abs err | ok |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {r['shape'][0]}x{r['shape'][1]} | {r['batch']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | "
            f"{r['bf16_over_fp8']:.2f} | {r['max_abs_err']:.3g} | {'yes' if r['ok'] else '**NO**'} |"
            for r in q["rows"]]
    return out
