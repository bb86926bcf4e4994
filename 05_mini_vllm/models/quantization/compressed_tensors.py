"""Reading a compressed-tensors `quantization_config` (the format llm-compressor writes, and
the one vLLM 0.32 reads for Qwen3 FP8 checkpoints such as its FP8_DYNAMIC recipe's).

vLLM counterpart: `vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py`
(`CompressedTensorsConfig.from_config`, `_get_scheme_from_parts`).

The subset understood here, each other value a ValueError naming the field:
* one entry in `config_groups`, targeting "Linear"; `ignore` names at most lm_head;
* `weights`: 8 bits, symmetric, static (`dynamic` false), strategy "tensor" or "channel",
  type "float" (e4m3fn, format "float-quantized" or "naive-quantized") or "int"
  (format "int-quantized" or "naive-quantized": int8 stored unpacked);
* `input_activations`: null (weight-only), or for float weights 8-bit float, dynamic, strategy
  "token" or "tensor" (W8A8). int8 W8A8 (int8 activations) is not implemented.
"""
from __future__ import annotations

import torch

from .fp8 import Fp8Config
from .int8 import Int8Config

_FORMATS = {"float": ("float-quantized", "naive-quantized"), "int": ("int-quantized", "naive-quantized")}


def _need(cond: bool, source: str, field: str, allowed: str, got) -> None:
    if not cond:
        raise ValueError(f"{source}: quantization_config.{field} must be {allowed}, got {got!r}")


def compressed_tensors_config(cfg: dict, device: torch.device, source: str):
    """The Fp8Config or Int8Config a compressed-tensors config describes."""
    groups = cfg.get("config_groups")
    _need(isinstance(groups, dict) and len(groups) == 1, source, "config_groups", "one group", groups)
    (gname, group), = groups.items()
    where = f"config_groups.{gname}"
    _need(group.get("targets") == ["Linear"], source, f"{where}.targets", "['Linear']", group.get("targets"))
    ignore = cfg.get("ignore") or []
    _need(set(ignore) <= {"lm_head"}, source, "ignore", "[] or ['lm_head'] (lm_head stays unquantized)", ignore)
    w = group.get("weights") or {}
    _need(w.get("num_bits") == 8, source, f"{where}.weights.num_bits", "8", w.get("num_bits"))
    _need(w.get("type") in _FORMATS, source, f"{where}.weights.type", "'float' or 'int'", w.get("type"))
    _need(w.get("symmetric", True) is True, source, f"{where}.weights.symmetric", "true", w.get("symmetric"))
    _need(not w.get("dynamic", False), source, f"{where}.weights.dynamic", "false", w.get("dynamic"))
    _need(w.get("strategy") in ("tensor", "channel"), source, f"{where}.weights.strategy",
          "'tensor' or 'channel'", w.get("strategy"))
    fmt = cfg.get("format", group.get("format"))
    _need(fmt in _FORMATS[w["type"]], source, "format", " or ".join(map(repr, _FORMATS[w["type"]])), fmt)
    a = group.get("input_activations")
    per_channel = w["strategy"] == "channel"
    if w["type"] == "int":
        _need(a is None, source, f"{where}.input_activations", "null for int weights (weight-only; int8 "
              "activations are not implemented)", a)
        if not per_channel:
            raise ValueError(f"{source}: quantization_config.{where}.weights.strategy must be 'channel' for int "
                             "weights (the int8 kernel takes per-channel scales), got 'tensor'")
        return Int8Config("compressed-tensors", serialized=True)
    if a is None:
        return Fp8Config("compressed-tensors", per_channel, serialized=True, activation=None)
    _need(a.get("num_bits") == 8 and a.get("type") == "float", source, f"{where}.input_activations",
          "8-bit float", a)
    _need(a.get("dynamic") is True, source, f"{where}.input_activations.dynamic", "true (static input scales "
          "are not implemented)", a.get("dynamic"))
    _need(a.get("strategy") in ("token", "tensor"), source, f"{where}.input_activations.strategy",
          "'token' or 'tensor'", a.get("strategy"))
    return Fp8Config("compressed-tensors", per_channel, serialized=True, activation=a["strategy"])
