"""int8 weights, weight-only (W8A16), one scale per output channel: the CPU's 8-bit scheme.

vLLM counterpart: the scheme is vLLM's `kInt8StaticChannelSym` (`quantization/utils/quant_utils.py`),
the weight side of `quantization/online/int8.py` (`Int8OnlineMoEMethod`: per-row scales
max|w| / 127, round, clip to +-127) and of compressed-tensors' int8 checkpoints
(`compressed_tensors/schemes/compressed_tensors_w8a16*.py` for weight-only). vLLM 0.32 accepts
`quantization="int8_per_channel_weight_only"` for the experts of mixture-of-experts models only
(its dense linears stay unquantized); here the same name quantizes every linear layer but
lm_head, since the course's models are dense.

Matmul: `kernels/cpu_int8_linear.py` on the CPU (the int8 weight widened in registers,
scale applied after the fp32 sum), its torch reference elsewhere and while `torch.compile`
traces (the compiled kernel is not traceable). The activations stay in the model's dtype:
the only error is the weight's rounding, |w - q s| <= s / 2.
"""
from __future__ import annotations

import torch

from mini_vllm.kernels.cpu_int8_linear import int8_linear, int8_linear_reference

from . import quant_utils as qu
from .base_config import QuantizationConfig, QuantizeMethodBase, replace_parameter
from .loading import add_scale_parameter, checked_weight_loader


class Int8LinearMethod(QuantizeMethodBase):
    """One layer's int8 weight: loaded (`serialized`) or quantized at load."""

    def __init__(self, serialized: bool):
        self.serialized = serialized
        self.quantized = False  # a second quantization is refused

    def create_weights(self, layer) -> None:
        if self.serialized:
            n, k = layer.weight.shape
            replace_parameter(layer, "weight", torch.empty(n, k, dtype=torch.int8))
            layer.weight.weight_loader = checked_weight_loader(layer.weight_loader, torch.int8, "I8")
            add_scale_parameter(layer)

    def process_weights_after_loading(self, layer) -> None:
        if self.quantized:
            raise RuntimeError("process_weights_after_loading called twice: the weight is int8 already")
        if not self.serialized:
            w = layer.weight.data
            scale = qu.int8_weight_scale(w)
            replace_parameter(layer, "weight", qu.quantize_int8(w, scale).contiguous())
            replace_parameter(layer, "weight_scale", scale)
        self.quantized = True

    def apply(self, layer, x, bias):
        if torch.compiler.is_compiling():
            return int8_linear_reference(x, layer.weight, layer.weight_scale, bias)
        return int8_linear(x, layer.weight, layer.weight_scale, bias)


class Int8Config(QuantizationConfig):
    def __init__(self, name: str, serialized: bool):
        self.name, self.serialized = name, serialized

    def get_quant_method(self, layer) -> Int8LinearMethod:
        return Int8LinearMethod(self.serialized)
