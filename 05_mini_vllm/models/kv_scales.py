"""Per-layer k_scale / v_scale of an fp8 KV cache: read from the checkpoint, then chosen.

vLLM counterparts: `maybe_remap_kv_scale_name` (`vllm/model_executor/model_loader/
weight_utils.py`), which maps a checkpoint's scale names onto `<layer>.attn.k_scale` /
`v_scale`, and `BaseKVCacheMethod.process_weights_after_loading`
(`vllm/model_executor/layers/quantization/kv_cache.py`), which picks the scales used.

Names read (the attention module of layer i is `model.layers.i.self_attn.attn`):
`...self_attn.k_scale` / `v_scale`, `...self_attn.attn.k_scale` / `v_scale`,
`...self_attn.k_proj.k_scale` / `v_proj.v_scale` (ModelOpt), `...self_attn.qkv_proj.k_scale`
/ `v_scale`, and the deprecated single `...self_attn.kv_scale` (both scales).

Which scales a layer uses (`configure_kv_scales`), as vLLM decides:
* a cache that is not fp8: 1.0 and 1.0, whatever the checkpoint holds;
* fp8 with `calculate_kv_scales`: computed from the first step that writes K/V
  (`Attention.calc_kv_scales`), whatever the checkpoint holds;
* fp8 with both scales in the checkpoint: those; with one (a kv_scale, or only
  k_scale or only v_scale): that one for both;
* fp8 with none: 1.0 and 1.0 (vLLM's default).
Invariant: a scale read is a finite number > 0, one value per tensor (vLLM: "Only
support per-tensor scaling factor for fp8 KV cache"); anything else is a ValueError.
"""
from __future__ import annotations

import math
import re

import torch

from mini_vllm.kernels.kv_cache_dtype import is_fp8

# checkpoint name -> (the layer's self_attn prefix, which scale); most specific first.
_PATTERNS = (
    (re.compile(r"^(.*\.self_attn)\.attn\.([kv])_scale$"), None),
    (re.compile(r"^(.*\.self_attn)\.([kv])_proj\.[kv]_scale$"), None),
    (re.compile(r"^(.*\.self_attn)\.qkv_proj\.([kv])_scale$"), None),
    (re.compile(r"^(.*\.self_attn)\.([kv])_scale$"), None),
    (re.compile(r"^(.*\.self_attn)\.kv_scale$"), "kv"),
)


def parse_kv_scale_name(name: str) -> tuple[str, str] | None:
    """(path of the layer's Attention module, "k" / "v" / "kv"), or None for another tensor."""
    for pattern, kind in _PATTERNS:
        m = pattern.match(name)
        if m:
            return m.group(1) + ".attn", kind or m.group(2)
    return None


def scale_value(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise ValueError(f"KV-cache scale {name!r} must hold one value (per-tensor), got shape "
                         f"{tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"KV-cache scale {name!r} must be a finite number > 0, got {value!r}")
    return value


def set_checkpoint_scales(model, found: dict[str, torch.Tensor]) -> None:
    """Store the scales `found` (checkpoint name -> tensor) on their layers' `checkpoint_kv_scales`."""
    per_layer: dict[str, dict[str, float]] = {}
    for name, tensor in found.items():
        path, kind = parse_kv_scale_name(name)
        value = scale_value(name, tensor)
        for k in ("k", "v") if kind == "kv" else (kind,):
            per_layer.setdefault(path, {})[k] = value
    for path, scales in per_layer.items():
        try:
            layer = model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"KV-cache scale for {path!r}: the model has no such attention layer") from None
        # One scale given: vLLM duplicates it (the deprecated kv_scale, or a lone k_/v_scale).
        one = max(scales.values())
        layer.checkpoint_kv_scales = (scales.get("k", one), scales.get("v", one))


def configure_kv_scales(layers, cache_dtype: torch.dtype, calculate: bool) -> None:
    """Each layer's k_scale / v_scale for a cache of `cache_dtype` (rules in the module docstring).
    Called once the cache is allocated and any warm-up steps have run."""
    if calculate and not is_fp8(cache_dtype):
        raise ValueError(f"calculate_kv_scales needs an fp8 KV cache, got {cache_dtype}")
    for layer in layers:
        layer.k_scale, layer.v_scale = 1.0, 1.0
        if is_fp8(cache_dtype) and layer.checkpoint_kv_scales is not None:
            layer.k_scale, layer.v_scale = layer.checkpoint_kv_scales
        layer.calculate_kv_scales = calculate
