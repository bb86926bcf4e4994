"""Loading 8-bit checkpoint tensors into the merged linear layers: the weight's dtype is
checked, and each part's `weight_scale` lands on that part's rows.

vLLM counterpart: `vllm/model_executor/parameter.py` (`PerTensorScaleParameter`,
`ChannelQuantScaleParameter`: a merged layer's scales loaded shard by shard) and the
weight loaders of `vllm/model_executor/layers/linear.py`.

Invariants:
* a layer's `weight_scale` is fp32 [N], one scale per output row; a checkpoint's per-tensor
  scale of a part (q_proj's, gate_proj's: shape [] or [1]) fills that part's rows, a
  per-channel one ([rows] or [rows, 1]) is copied row for row; any other shape is a
  ValueError naming both shapes;
* an 8-bit weight is copied only from a tensor of the expected dtype: a bf16 tensor where
  fp8 is expected would be cast without its scale, and an e5m2 tensor read as e4m3 would be
  garbage, so either is a ValueError naming both dtypes;
* one rank only: `load_model` refuses quantization with tensor parallelism.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers import weight_shape

# safetensors' names of the dtypes an 8-bit checkpoint may hold
_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I8": torch.int8,
                       "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def tensor_dtype(loaded) -> torch.dtype | str:
    """The dtype of a tensor or of a lazy safetensors slice (its name if torch has none)."""
    if isinstance(loaded, torch.Tensor):
        return loaded.dtype
    name = loaded.get_dtype()
    return _SAFETENSORS_DTYPES.get(name, name)


def checked_weight_loader(layer_loader, dtype: torch.dtype, name: str):
    """`layer_loader` (the layer's row-range loader), refusing tensors not of `dtype`."""
    def load(param, loaded, shard_id=None):
        got = tensor_dtype(loaded)
        if got != dtype:
            raise ValueError(f"weight dtype mismatch: the checkpoint tensor is {got}, the quantization "
                             f"config expects {dtype} ({name})")
        if shard_id is None:
            return layer_loader(param, loaded)
        return layer_loader(param, loaded, shard_id)
    return load


def add_scale_parameter(layer) -> None:
    """Declares `layer.weight_scale` fp32 [N] (ones until loaded) with its shard-aware loader."""
    layer.weight_scale = nn.Parameter(torch.ones(layer.weight.shape[0], dtype=torch.float32),
                                      requires_grad=False)

    def load(param, loaded, shard_id=None):
        start, size = layer.shard_rows(shard_id)
        t = (loaded if isinstance(loaded, torch.Tensor) else loaded[:]).float()
        if t.numel() == 1:  # a per-tensor scale of this part
            value = t.reshape(())
        elif weight_shape(t) in ((size,), (size, 1)):
            value = t.reshape(size)
        else:
            raise ValueError(f"weight_scale shape mismatch for part {shard_id!r}: checkpoint tensor has shape "
                             f"{weight_shape(t)}, expected [] or [1] (per tensor) or [{size}] / [{size}, 1] "
                             "(per channel)")
        if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
            raise ValueError(f"weight_scale of part {shard_id!r} must be finite and > 0")
        with torch.no_grad():
            param.data.narrow(0, start, size).copy_(value)

    layer.weight_scale.weight_loader = load
