"""FP8 weights against real vLLM 0.32 CPU (`.venv-vllm`, `make vllm`), in the one mode vLLM's
CPU build runs on a CPU without AMX: `quantization="fp8_per_channel"` (per-channel weight
scales, dynamic per-token activation scales, `torch._scaled_mm` through vLLM's
`ChannelWiseTorchFP8ScaledMMLinearKernel`).

What vLLM 0.32 CPU does not run here, so has no oracle: "fp8" / "fp8_per_tensor" (its online
per-tensor path calls `_C.static_scaled_fp8_quant`, which the CPU build does not register);
FP8 weight-only and int8 weight-only checkpoints (their CPU kernels need AMX, or none is found:
"Failed to find a kernel that can implement the ScaledMM linear layer"); any FP8 mode in fp32
("torch.float32 is not supported for quantization method fp8"). int8 W8A8 (vLLM's oneDNN
kernel) quantizes activations to int8, which the course's int8 scheme (weight-only) does not.

Two comparisons:
1. Layer by layer, exact: vLLM's own functions (benchmarks/vllm_quant_ops.py, run in
   `.venv-vllm`) on the tiny target's real weights and activations give the same weight
   scales and fp8 codes, the same activation scales and codes, and the same product, bit for
   bit, in bf16 and fp16.
2. Engine against engine, fp16: vLLM reads the course's compressed-tensors FP8 checkpoint
   (`write_quantized_checkpoint`) and generates exactly what its own online fp8_per_channel
   generates, so the checkpoint holds vLLM's quantization; the course's engine stays near
   vLLM's. Not exact: the two engines' fp16 activations differ in the last bits (measured
   without quantization: top-1 logprobs within 0.008, 98% of positions before a near-tie), and
   FP8's 3-bit rounding of activations turns a last-bit difference into a whole step for the
   values near a rounding boundary. Measured on 32 corpus prompts x 16 greedy tokens (Zen 3):
   86% of positions compared before the first divergence, every divergence at a vLLM top-2
   margin <= 0.15, top-1 logprob gap 0.024 mean, 0.217 max; the thresholds below leave about
   a third more room.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from vllm_side import MISSING, _env, request, run_mini, run_vllm_jobs, vllm_job, vllm_python  # noqa: E402

from mini_vllm.course.tiny_models import model_path  # noqa: E402
from mini_vllm.models.loader import load_model  # noqa: E402
from mini_vllm.models.quantization import quant_utils as qu  # noqa: E402
from mini_vllm.models.quantization.checkpoint import write_quantized_checkpoint  # noqa: E402
from mini_vllm.models.quantization.fp8 import fp8_scaled_mm  # noqa: E402

pytestmark = pytest.mark.skipif(vllm_python() is None, reason=MISSING)

OPS = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_quant_ops.py"
TARGET = model_path("tiny-py-target")
COMMON = dict(block_size=32, kv_cache_memory_bytes=64 << 20, max_num_seqs=64, max_num_batched_tokens=2048)
MIN_COMPARED, MAX_MEAN_GAP, MAX_GAP, MAX_DIVERGENCE_MARGIN = 0.75, 0.035, 0.35, 0.25


def _cases(dtype: torch.dtype) -> list[dict]:
    """Real weights of four linear kinds, each with activations of its input width."""
    model, _ = load_model(TARGET, dtype=dtype, attention_backend="torch")
    layer = model.model.layers[3]
    g = torch.Generator().manual_seed(3)
    out = []
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        w = lin.weight.detach().clone()
        x = (torch.randn(19, w.shape[1], generator=g) * torch.logspace(-2, 1, 19).unsqueeze(1)).to(dtype)
        out.append({"w": w, "x": x})
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_quantization_and_product_bit_equal_vllms_functions(tmp_path, dtype):
    cases = _cases(dtype)
    torch.save({"cases": cases}, tmp_path / "in.pt")
    proc = subprocess.run([str(vllm_python()), str(OPS), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          env=_env(1, True), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for i, (case, want) in enumerate(zip(cases, torch.load(tmp_path / "out.pt")["cases"])):
        w_scale = qu.fp8_weight_scale(case["w"], per_channel=True)
        w_q = qu.quantize_fp8(case["w"], w_scale)
        x_q, x_scale = qu.quantize_activation_fp8(case["x"], per_token=True)
        assert torch.equal(w_scale, want["w_scale"]), f"case {i}: per-channel weight scales differ from vLLM's"
        assert torch.equal(w_q.view(torch.uint8), want["w_q"].view(torch.uint8)), f"case {i}: fp8 weight codes differ"
        assert torch.equal(x_scale, want["x_scale"]), f"case {i}: per-token activation scales differ from vLLM's"
        assert torch.equal(x_q.view(torch.uint8), want["x_q"].view(torch.uint8)), f"case {i}: activation codes differ"
        y = fp8_scaled_mm(x_q, x_scale, w_q, w_scale, None, dtype)
        assert torch.equal(y, want["y"]), f"case {i}: the W8A8 product differs from vLLM's kernel"


def _phase() -> dict:
    from engine_workloads import sample_requests
    prompts = [p for p, _ in sample_requests(32, (4, 300), (1, 1), seed=11)]
    return {"name": "fp8", "requests": [request(p, max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
                                        for p in prompts]}


def _first_divergences(want: dict, got: dict):
    """(positions compared, positions in all, top-1 logprob gaps, vLLM's top-2 margins where the tokens part)."""
    compared = total = 0
    gaps, margins = [], []
    for w, g in zip(want["results"], got["results"]):
        wc, gc = w["outputs"][0], g["outputs"][0]
        total += len(wc["token_ids"])
        for i, (a, b) in enumerate(zip(wc["token_ids"], gc["token_ids"])):
            wl = {t: lp for t, lp, _ in wc["logprobs"][i]}
            if a != b:
                top = sorted(wl.values(), reverse=True)
                margins.append(top[0] - top[1])
                break
            compared += 1
            gaps.append(abs(wl[a] - {t: lp for t, lp, _ in gc["logprobs"][i]}[a]))
    return compared, total, gaps, margins


def test_engine_fp8_per_channel_near_vllm_and_checkpoint_read_alike(tmp_path):
    ckpt = write_quantized_checkpoint(TARGET, tmp_path / "ct", "fp8_per_channel")
    phase = _phase()
    online, from_ckpt = run_vllm_jobs([
        vllm_job(TARGET, [phase], dtype="float16", enforce_eager=True, quantization="fp8_per_channel", **COMMON),
        vllm_job(ckpt, [phase], dtype="float16", enforce_eager=True, **COMMON)], in_process=True)
    want, want_ckpt = online["phases"][0], from_ckpt["phases"][0]
    assert want_ckpt["results"] == want["results"], (
        "vLLM generates otherwise from the course's compressed-tensors checkpoint than from its own online "
        "fp8_per_channel: the checkpoint's fp8 codes or scales are not vLLM's")
    got = run_mini(TARGET, [phase], dtype="float16", quantization="fp8_per_channel", **COMMON)["phases"][0]
    compared, total, gaps, margins = _first_divergences(want, got)
    report = (f"{compared}/{total} positions compared, top-1 gap mean {sum(gaps) / len(gaps):.4f} max "
              f"{max(gaps):.4f}, divergence margins {sorted(margins)[-3:]}")
    assert compared >= MIN_COMPARED * total, f"continuations part from vLLM's too early: {report}"
    assert sum(gaps) / len(gaps) <= MAX_MEAN_GAP and max(gaps) <= MAX_GAP, f"logprobs too far from vLLM's: {report}"
    assert all(m <= MAX_DIVERGENCE_MARGIN for m in margins), f"a token differs where vLLM was sure: {report}"
