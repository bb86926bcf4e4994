"""FP8 (e4m3) weights: quantized at load from a bf16 / fp16 checkpoint, or loaded from an FP8
checkpoint; multiplied W8A8 through `torch._scaled_mm` with dynamic activation scales, or
weight-only where the checkpoint says so.

vLLM counterpart: `vllm/model_executor/layers/quantization/fp8.py` (`Fp8Config`,
`Fp8LinearMethod`: checkpoints), `quantization/online/fp8.py` (`Fp8PerTensorOnlineLinearMethod`,
`Fp8PtpcOnlineLinearMethod`: `quantization="fp8_per_tensor"` / `"fp8_per_channel"`, and "fp8"
on an unquantized checkpoint, which vLLM 0.32 takes as "fp8_per_tensor"), and the CPU kernels
it picks on a CPU without AMX, `kernels/linear/scaled_mm/pytorch.py`
(`ChannelWiseTorchFP8ScaledMMLinearKernel`: `_scaled_mm` with unit scales into fp32, then
times the activation scales and the weight scales, plus the bias).

Numerics (the same as vLLM's, which `tests/test_vs_vllm_quant.py` checks):
* weight: q = fp8(w / s), s = max|w| / 448 per tensor (one scale for a merged q|k|v or
  gate|up weight) or per output row; stored as `weight` float8_e4m3fn [N, K] and
  `weight_scale` fp32 [N] (a per-tensor scale repeated on every row, so that a checkpoint's
  q, k and v may each bring their own);
* activation ("dynamic"): on every call, x_q = fp8(x / s_x), s_x = max|x| / 448 per token
  (per-channel weights, and per-tensor weights on CUDA, where vLLM has CUTLASS) or per
  tensor (per-tensor weights elsewhere, vLLM's CPU choice);
* y = (x_q @ q.T) * s_x * s_w (+ bias), accumulated in fp32, cast to x's dtype.
`fp8_linear_reference` computes the same from dequantized fp32 tensors: where `_scaled_mm`
cannot run (`scaled_mm_supported`: CUDA before sm89, shapes it refuses) the layer takes it,
with identical numerics up to the fp32 summation order.

Weight-only (a compressed-tensors checkpoint with no `input_activations`): y = x @ (q * s).T,
the weight dequantized to x's dtype on each call (vLLM serves this with Marlin on GPUs).

Refused, with an error naming the field: fp32 models (vLLM: FP8 runs bf16 / fp16 models only),
static activation scales, block-wise scales (`weight_block_size`), fp8 tensors in another
format than e4m3fn, checkpoint layers left unquantized other than lm_head.
"""
from __future__ import annotations

import torch

from . import quant_utils as qu
from .base_config import QuantizationConfig, QuantizeMethodBase, replace_parameter
from .loading import add_scale_parameter, checked_weight_loader

_SCALED_MM_OK: dict[str, bool] = {}


def scaled_mm_supported(device: torch.device) -> bool:
    """Can `torch._scaled_mm` multiply fp8 here? CPU builds of torch >= 2.5 can (slowly:
    no fp8 arithmetic, as vLLM's CPU build without AMX); CUDA needs sm89 (Ada) or newer.
    Probed once per device type."""
    kind = device.type
    if kind not in _SCALED_MM_OK:
        ok = kind in ("cpu", "cuda") and (kind != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9))
        if ok:
            try:
                a = torch.zeros(16, 16, device=device, dtype=qu.FP8_DTYPE)
                one = torch.ones((), device=device)
                torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            except (RuntimeError, NotImplementedError, AttributeError):
                ok = False
        _SCALED_MM_OK[kind] = ok
    return _SCALED_MM_OK[kind]


def fp8_linear_reference(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> torch.Tensor:
    """The oracle of the W8A8 matmul: dequantized fp32 operands, y = (x_q s_x) (q s_w).T + b."""
    out = (x_q.float() @ w_q.float().t()) * x_scale * w_scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_scaled_mm(x_q, x_scale, w_q, w_scale, bias, out_dtype) -> torch.Tensor:
    """The W8A8 matmul through `torch._scaled_mm` (fp32 out, unit scales), then the scales and
    the bias in fp32, as vLLM's channel-wise torch kernel does."""
    one = torch.ones((), device=x_q.device)
    acc = torch._scaled_mm(x_q, w_q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    out = acc * x_scale * w_scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


class Fp8LinearMethod(QuantizeMethodBase):
    """One layer's FP8 weight: `serialized` (fp8 tensors in the checkpoint) or quantized at load;
    `activation` "token", "tensor" (dynamic W8A8) or None (weight-only)."""

    def __init__(self, per_channel: bool, serialized: bool, activation: str | None):
        self.per_channel, self.serialized, self.activation = per_channel, serialized, activation
        self.quantized = False  # set once the weight is fp8 (a second quantization is refused)
        self.use_scaled_mm = False  # decided per layer after loading (device, shapes)

    def create_weights(self, layer) -> None:
        if self.serialized:  # the checkpoint brings fp8 tensors and their scales
            n, k = layer.weight.shape
            replace_parameter(layer, "weight", torch.empty(n, k, dtype=qu.FP8_DTYPE))
            layer.weight.weight_loader = checked_weight_loader(layer.weight_loader, qu.FP8_DTYPE, "F8_E4M3")
            add_scale_parameter(layer)

    def process_weights_after_loading(self, layer) -> None:
        if self.quantized:
            raise RuntimeError("process_weights_after_loading called twice: the weight is fp8 already")
        if not self.serialized:
            w = layer.weight.data
            scale = qu.fp8_weight_scale(w, self.per_channel).expand(w.shape[0]).contiguous()
            replace_parameter(layer, "weight", qu.quantize_fp8(w, scale))
            replace_parameter(layer, "weight_scale", scale)
        self.quantized = True
        n, k = layer.weight.shape
        self.use_scaled_mm = (self.activation is not None and n % 16 == 0 and k % 16 == 0
                              and scaled_mm_supported(layer.weight.device))

    def apply(self, layer, x, bias):
        rows = x.reshape(-1, x.shape[-1])
        if self.activation is None:  # weight-only: dequantize, multiply in x's dtype
            w = qu.dequantize_fp8(layer.weight, layer.weight_scale).to(x.dtype)
            out = torch.nn.functional.linear(rows, w, bias)
        else:
            x_q, x_scale = qu.quantize_activation_fp8(rows, per_token=self.activation == "token")
            mm = fp8_scaled_mm if self.use_scaled_mm else fp8_linear_reference
            out = mm(x_q, x_scale, layer.weight, layer.weight_scale, bias, x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])


class Fp8Config(QuantizationConfig):
    """The model-wide FP8 scheme (see the module docstring); `name` is the vLLM name it came
    from ("fp8", "fp8_per_tensor", "fp8_per_channel" or "compressed-tensors")."""

    def __init__(self, name: str, per_channel: bool, serialized: bool, activation: str | None):
        if activation not in ("token", "tensor", None):
            raise ValueError(f"activation must be 'token', 'tensor' or None, got {activation!r}")
        self.name, self.per_channel, self.serialized, self.activation = name, per_channel, serialized, activation

    def get_quant_method(self, layer) -> Fp8LinearMethod:
        return Fp8LinearMethod(self.per_channel, self.serialized, self.activation)

    def supported_act_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16)


def dynamic_activation(per_channel_weights: bool, device: torch.device) -> str:
    """vLLM's choice of activation scales for W8A8: per token with per-channel weights, and with
    per-tensor weights where CUTLASS runs (CUDA); per tensor otherwise."""
    return "token" if per_channel_weights or device.type == "cuda" else "tensor"


def online_fp8_config(name: str, device: torch.device) -> Fp8Config:
    per_channel = name == "fp8_per_channel"
    return Fp8Config(name, per_channel, serialized=False, activation=dynamic_activation(per_channel, device))


def fp8_checkpoint_config(cfg: dict, device: torch.device, source: str) -> Fp8Config:
    """A `quantization_config` with quant_method "fp8" (vLLM's own FP8 format): per-tensor
    `weight_scale` per checkpoint linear, dynamic activations."""
    if cfg.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{source}: quantization_config.activation_scheme must be 'dynamic', got "
                         f"{cfg.get('activation_scheme')!r} (static input scales are not implemented)")
    if cfg.get("weight_block_size") is not None:
        raise ValueError(f"{source}: quantization_config.weight_block_size must be null (block-wise FP8 "
                         f"scales are not implemented), got {cfg['weight_block_size']!r}")
    skipped = cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or []
    if set(skipped) - {"lm_head"}:
        raise ValueError(f"{source}: quantization_config.ignored_layers may name only 'lm_head' (which stays "
                         f"unquantized anyway), got {skipped!r}")
    return Fp8Config("fp8", per_channel=False, serialized=True, activation=dynamic_activation(False, device))
