"""What a linear layer asks of a quantization scheme, and the unquantized scheme.

vLLM counterpart: `vllm/model_executor/layers/quantization/base_config.py`
(`QuantizeMethodBase`, `QuantizationConfig`) and `UnquantizedLinearMethod` in
`vllm/model_executor/layers/linear.py`.

A `QuantizationConfig` is the model-wide choice (from the `quantization` engine argument
and/or the checkpoint's `quantization_config`); for each linear layer it hands out a
`QuantizeMethodBase`, which the layer keeps as `layer.quant_method` and calls three times:
* `create_weights(layer)` in the layer's `__init__`, after the layer made its full-precision
  `weight` (a method that loads 8-bit tensors replaces it and adds `weight_scale`);
* `process_weights_after_loading(layer)` once every checkpoint tensor is in (online
  quantization happens here: the full-precision weight is replaced by its 8-bit version);
* `apply(layer, x, bias)` on every forward pass: x @ W.T (+ bias) in x's dtype.

Invariants: the layer declares `weight_scale` (None unless a method sets it); a method never
quantizes a layer twice (`process_weights_after_loading` after the first call is refused),
since a second pass would take the 8-bit weight for a full-precision one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from .. import cpu_ops


class QuantizeMethodBase(ABC):
    """How one layer stores and multiplies its weight."""

    def create_weights(self, layer: nn.Module) -> None:
        """Make or replace the parameters the checkpoint fills (default: keep the layer's)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded parameters into the ones `apply` reads (default: nothing to do)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] @ W.T (+ bias) -> [..., N] in x's dtype."""


class UnquantizedLinearMethod(QuantizeMethodBase):
    """The full-precision matmul: `cpu_ops.linear` (packed weights on the CPU, F.linear elsewhere)."""

    def apply(self, layer, x, bias):
        return cpu_ops.linear(x, layer.weight, bias, layer)


class QuantizationConfig(ABC):
    """A model-wide quantization scheme: its vLLM name and the method of each linear layer."""

    name: str = ""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module) -> QuantizeMethodBase:
        """The method of one linear layer (lm_head and embeddings are not linear layers: they stay
        in the model's dtype, as in vLLM)."""

    def supported_act_dtypes(self) -> tuple[torch.dtype, ...]:
        """Model dtypes this scheme runs in; `load_model` refuses the others."""
        return (torch.float32, torch.bfloat16, torch.float16)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def replace_parameter(layer: nn.Module, name: str, data: torch.Tensor) -> None:
    """Swap a declared parameter of `layer` for a new frozen one holding `data` (another dtype
    or shape), keeping its weight loader. A parameter, not a buffer: `named_parameters` (the
    loader, the TP tests) keeps seeing it."""
    old = getattr(layer, name)
    new = nn.Parameter(data, requires_grad=False)
    if old is not None and hasattr(old, "weight_loader"):
        new.weight_loader = old.weight_loader
    setattr(layer, name, new)
