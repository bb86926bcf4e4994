"""The KV cache's storage dtype (`kv_cache_dtype`) and its fp8 quantize/dequantize pair.

vLLM counterparts: `CacheConfig.cache_dtype` (`vllm/config/cache.py`, the names
"auto", "fp8", "fp8_e4m3", "fp8_e5m2"), `kv_cache_dtype_str_to_dtype` and
`is_quantized_kv_cache` (`vllm/utils/torch_utils.py`), and the per-element
conversion of `reshape_and_cache` (`csrc/cache_kernels.cu`,
`csrc/quantization/fp8/nvidia/quant_utils.cuh`: `scaled_convert`).

Semantics, as vLLM's:
* "auto" stores K/V in the model's dtype; "fp8" means "fp8_e4m3" (OCP E4M3,
  torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, largest 448, no inf);
  "fp8_e5m2" is torch.float8_e5m2 (5 exponent bits, 2 mantissa bits, largest
  57344, IEEE-like with inf). vLLM stores both as uint8 bytes and passes the
  format beside them; here the cache tensor has the float8 dtype itself, so the
  tensor records its format and no call can pair bytes with the wrong one.
* per-tensor scales, one k_scale and one v_scale per layer:
  stored = fp8(x / scale), dequantised = float(stored) * scale. The division
  and the conversion are fp32 arithmetic; the conversion rounds to nearest
  even and saturates at the format's largest finite value (CUDA's
  `__NV_SATFINITE`, which vLLM's conversion uses): a large key becomes +-max,
  never NaN or inf.
* scale 1.0 when none is given or computed (vLLM's default); a non-fp8 cache
  takes scale 1.0 only (vLLM forces 1.0 there; here another value is an error,
  so a scale is never accepted and ignored).

Invariant: `dequantize(quantize(x, s), s)` differs from x by at most half a
unit in the last place of the format at x / s (relative 2**-4 for e4m3, 2**-3
for e5m2 in the normal range), times s, unless x / s is past the largest
finite value (then it is saturated).
"""
from __future__ import annotations

import math

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_BY_NAME = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def check_kv_cache_dtype(kv_cache_dtype) -> str:
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype: the model's for "auto", else the fp8 format named."""
    check_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if kv_cache_dtype == "auto" else _FP8_BY_NAME[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def check_kv_scale(name: str, value, cache_dtype: torch.dtype) -> float:
    """A per-tensor scale: a finite number > 0; exactly 1.0 for a cache that is not fp8."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not is_fp8(cache_dtype) and value != 1.0:
        raise ValueError(f"{name} must be 1.0 for a {str(cache_dtype).removeprefix('torch.')} KV cache "
                         f"(scales apply to fp8 caches only), got {value!r}")
    return float(value)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8(x / scale), saturated to the format's finite range; x as it is for other dtypes."""
    if not is_fp8(dtype):
        return x.to(dtype)
    big = torch.finfo(dtype).max
    # clamp, then convert: torch's conversion alone turns |x| > max into NaN (e4m3fn) or inf (e5m2).
    return (x.float() / scale).clamp(-big, big).to(dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float32(stored) * scale: what every attention path reads from an fp8 cache."""
    return x.float() * scale if is_fp8(x.dtype) else x.float()


def fp8_table(dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The 256 values a byte of an fp8 cache stands for, times scale, in fp32: the
    numba kernel dequantises a byte b as table[b], the same fp32 product as `dequantize`."""
    if not is_fp8(dtype):
        raise ValueError(f"fp8_table needs an fp8 dtype {FP8_DTYPES}, got {dtype}")
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float() * scale


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor seen as uint8 (same memory): torch's CPU index_copy_/index_fill_
    have no float8 kernels, and a byte copy moves the same bits."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
