"""The quantize / dequantize pairs of 8-bit weights and activations, in plain PyTorch.

vLLM counterpart: `vllm/model_executor/layers/quantization/utils/quant_utils.py` and the
online methods' helpers in `quantization/online/fp8.py` (`_fp8_scale`, `_fp8_channel_scale`,
`_fp8_quant_per_channel`), `input_quant_fp8.py` (`QuantFP8.forward_native`, the dynamic
activation scales) and `online/int8.py` (per-row int8 scales).

Symmetric quantization: q = round(w / s) clipped to the format's range, w ~= q * s.
* FP8 e4m3fn: 4 exponent bits, 3 mantissa bits, largest finite value 448; the rounding to
  fp8 is the cast itself (to nearest even), so the relative error is at most 2^-4 for every
  value in the normal range. The scale maps the largest |w| to 448.
* int8: integers -127..127 (vLLM's symmetric range: -128 is left out so that q and -q both
  exist); the absolute error is at most s / 2, s = max|w| / 127.
* granularity: per tensor (one s), per channel (one s per output row, `weight_scale` [N]),
  per token for activations (one s per input row, computed on every call: "dynamic").

Invariants:
* every scale is fp32 and > 0: a zero row or tensor gets the smallest scale vLLM allows,
  MIN_SCALE (1 / (448 * 512)), instead of a division by zero;
* quantizing divides (true division, as vLLM's per-channel weight path and per-token
  activation kernels do; the per-token activation path multiplies by the reciprocal, as
  vLLM's `QuantFP8.forward_native` does, so both engines round the same way);
* `dequantize_*(quantize_*(w, s), s)` is within the format's error bound of w.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's _FP8_MIN_SCALING_FACTOR / channel-scale floor
INT8_MAX = 127


def _as_rows(scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A per-tensor ([] or [1]) or per-row ([N]) scale shaped to broadcast over w [N, K]."""
    return scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1)


def fp8_weight_scale(w: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """fp32 scale(s) mapping max|w| (of the tensor, or of each row) to FP8_MAX: [1] or [N]."""
    amax = w.abs().amax(dim=-1) if per_channel else w.abs().amax().reshape(1)
    return (amax.float() / FP8_MAX).clamp_min(MIN_SCALE)


def quantize_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [N, K] / scale, clipped to +-448, cast (round to nearest even) to float8_e4m3fn."""
    return (w.float() / _as_rows(scale, w)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale in fp32: the weight the quantized layer multiplies by."""
    return q.float() * _as_rows(scale, q)


def quantize_activation_fp8(x: torch.Tensor, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization of x [M, K]: (x_q fp8 [M, K], scale fp32 [M, 1] per token
    or [1, 1] per tensor), the scale from this call's own max|x| (vLLM's QuantFP8, dynamic)."""
    amax = x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax().reshape(1, 1)
    scale = (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)
    x_q = (x.float() * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q, scale


def int8_weight_scale(w: torch.Tensor) -> torch.Tensor:
    """fp32 per-row scales [N] mapping each row's max|w| to 127."""
    return (w.abs().amax(dim=-1).float() / INT8_MAX).clamp_min(MIN_SCALE)


def quantize_int8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(w / scale) clipped to [-127, 127], int8 [N, K]."""
    return (w.float() / _as_rows(scale, w)).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * _as_rows(scale, q)
