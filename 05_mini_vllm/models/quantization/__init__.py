"""8-bit weights: the `quantization` engine argument, the checkpoint's `quantization_config`,
and the scheme every linear layer is built with.

vLLM counterpart: `vllm/model_executor/layers/quantization/__init__.py`
(`QUANTIZATION_METHODS`, `get_quantization_config`), `vllm/config/quantization.py` (the online
shorthands) and the check in `vllm/config/model.py` (`ModelConfig._verify_quantization`).

The values of `quantization` (vLLM 0.32's names):
* None: the checkpoint's own `quantization_config` if it has one, else full precision;
* "fp8_per_tensor", "fp8_per_channel": FP8 weights quantized at load (`fp8.py`);
  "fp8" is "fp8_per_tensor" on an unquantized checkpoint (vLLM 0.32's deprecated alias) and
  vLLM's FP8 format on a checkpoint that declares quant_method "fp8";
* "compressed-tensors": a checkpoint in that format (`compressed_tensors.py`), FP8 or int8;
* "int8_per_channel_weight_only": int8 weights quantized at load, the CPU scheme (`int8.py`).

Invariants (each a ValueError naming the field and the allowed values):
* any other value of `quantization` is refused, never ignored;
* a checkpoint's quant_method must be one of CHECKPOINT_METHODS, and a `quantization`
  argument given beside it must name the same method (vLLM's rule: an FP8 checkpoint cannot
  be re-quantized to int8, nor an int8 one read as FP8);
* "compressed-tensors" needs a checkpoint that declares it.
The layers built inside `use_quant_config(config)` (`load_model` does it) take their method
from it; lm_head and the embeddings are not linear layers and stay unquantized, as in vLLM.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from .base_config import QuantizationConfig, QuantizeMethodBase, UnquantizedLinearMethod
from .compressed_tensors import compressed_tensors_config
from .fp8 import Fp8Config, fp8_checkpoint_config, online_fp8_config
from .int8 import Int8Config

ONLINE_METHODS = ("fp8", "fp8_per_tensor", "fp8_per_channel", "int8_per_channel_weight_only")
CHECKPOINT_METHODS = ("fp8", "compressed-tensors")
QUANTIZATION_METHODS = ("fp8", "fp8_per_tensor", "fp8_per_channel", "compressed-tensors",
                        "int8_per_channel_weight_only")

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase", "UnquantizedLinearMethod",
           "Fp8Config", "Int8Config", "check_quantization", "get_quantization_config",
           "use_quant_config", "get_current_quant_config", "quant_config_for_model"]


def check_quantization(value) -> None:
    if value is not None and value not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATION_METHODS}, got {value!r}")


def get_quantization_config(quantization: str | None, hf_quant_config: dict | None, device,
                            source: str = "config.json") -> QuantizationConfig | None:
    """The scheme for a model: from the checkpoint's `quantization_config` (`hf_quant_config`),
    checked against the `quantization` argument, else from the argument alone; None = full
    precision."""
    check_quantization(quantization)
    device = torch.device(device)
    if hf_quant_config is not None:
        if not isinstance(hf_quant_config, dict):
            raise ValueError(f"{source}: quantization_config must be an object, got {hf_quant_config!r}")
        method = hf_quant_config.get("quant_method")
        if method not in CHECKPOINT_METHODS:
            raise ValueError(f"{source}: quantization_config.quant_method must be one of {CHECKPOINT_METHODS}, "
                             f"got {method!r}")
        if quantization is not None and quantization != method:
            raise ValueError(f"quantization={quantization!r} does not match the checkpoint's "
                             f"quantization_config.quant_method {method!r} ({source}): leave quantization "
                             f"unset or pass {method!r}")
        if method == "fp8":
            return fp8_checkpoint_config(hf_quant_config, device, source)
        return compressed_tensors_config(hf_quant_config, device, source)
    if quantization is None:
        return None
    if quantization == "compressed-tensors":
        raise ValueError(f"quantization='compressed-tensors' needs a checkpoint whose config.json has a "
                         f"quantization_config; {source} has none")
    if quantization == "int8_per_channel_weight_only":
        return Int8Config(quantization, serialized=False)
    return online_fp8_config(quantization, device)


_CURRENT: list[QuantizationConfig | None] = [None]


@contextmanager
def use_quant_config(config: QuantizationConfig | None):
    """Linear layers built inside take their methods from `config` (None: unquantized)."""
    prev = _CURRENT[0]
    _CURRENT[0] = config
    try:
        yield
    finally:
        _CURRENT[0] = prev


def get_current_quant_config() -> QuantizationConfig | None:
    return _CURRENT[0]


def quant_config_for_model(quantization: str | None, hf_config: dict, dtype: torch.dtype, device,
                           source: str) -> QuantizationConfig | None:
    """`get_quantization_config` for a model about to be built in `dtype` on this rank: the
    scheme must run that dtype (FP8: bf16 / fp16 only, as in vLLM), and quantized layers are
    built on one rank only (the per-tensor scale of a split weight would need the ranks' max)."""
    from mini_vllm.distributed import get_tp_group

    config = get_quantization_config(quantization, hf_config.get("quantization_config"), device, source)
    if config is None:
        return None
    if dtype not in config.supported_act_dtypes():
        raise ValueError(f"dtype {dtype} is not supported for quantization {config.name!r}; supported dtypes: "
                         f"{list(config.supported_act_dtypes())}")
    if get_tp_group().world_size > 1:
        raise ValueError(f"quantization {config.name!r} needs tensor_parallel_size 1, got "
                         f"{get_tp_group().world_size}")
    return config
