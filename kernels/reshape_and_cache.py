"""Triton `reshape_and_cache`: scatter new keys/values into the paged cache.

vLLM counterparts: `reshape_and_cache` / `reshape_and_cache_flash` in
`csrc/cache_kernels.cu`, and the Triton port
`vllm/attention/ops/triton_reshape_and_cache_flash.py`. Same signature and
errors as the PyTorch reference `mini_vllm.paged_attention.reshape_and_cache`.

Invariants: slot = block * block_size + offset; slot -1 marks a padding token
and writes nothing; real slots are in [0, num_blocks * block_size) and are
distinct within one call (the scheduler guarantees it). slot_mapping may be
a strided view; the wrapper makes it contiguous for the kernel. Values are copied
bit for bit (no arithmetic, so bf16 is safe under the interpreter), except into
an fp8 cache: there each value becomes fp8(x / scale) in fp32 arithmetic,
clamped to the format's largest finite value first (`kv_cache_dtype.quantize`,
bit for bit). The rounding to the format's precision is done in fp32 integer
arithmetic (`_round_to_fp8`) and only the then exact value is converted: Triton's
interpreter converts a value whose rounding carries into the exponent to half
of it (31.6 -> 16 instead of 32 in e4m3), and an exact value converts the same
everywhere.
"""
from __future__ import annotations

import torch

from .triton_setup import require_triton_mode

require_triton_mode(__name__)  # before triton is first imported: see triton_setup.py

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .kv_cache_dtype import is_fp8
from .paged_checks import check_reshape_and_cache_args


@triton.jit
def _round_to_fp8(x, MANT_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr):
    """x (fp32, |x| <= the format's max) rounded to the nearest fp8 value, ties to even, kept in fp32.
    Normal range: round the fp32 mantissa to MANT_BITS bits on the integer bits (a carry moves into
    the exponent, as it must). Subnormal range (|x| < MIN_NORMAL): (|x| + M) - M with M's fp32 ulp
    equal to the format's smallest subnormal, so fp32's own round-to-even does it."""
    DROP: tl.constexpr = 23 - MANT_BITS
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & ~((1 << DROP) - 1)
    normal = bits.to(tl.float32, bitcast=True)
    a = tl.abs(x)
    sub = (a + SUB_MAGIC) - SUB_MAGIC
    return tl.where(a < MIN_NORMAL, tl.where(x < 0, -sub, sub), normal)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
    kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, vc_s3,
    num_kv_heads, head_dim, k_scale, v_scale, fp8_max,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
    MANT_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr,
):
    """Grid: (num_tokens,). One program copies one token's whole
    [num_kv_heads, head_dim] tile of K and of V: a token is the unit the slot
    mapping addresses, and one tile per token keeps every load/store a single
    vectorised access. Padding tokens (slot -1) mask everything off."""
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim) & (slot >= 0)
    tok64 = tok.to(tl.int64)
    k = tl.load(key_ptr + tok64 * k_s0 + h * k_s1 + d * k_s2, mask=mask)
    v = tl.load(value_ptr + tok64 * v_s0 + h * v_s1 + d * v_s2, mask=mask)
    if QUANT:  # fp8 cache: x / scale in fp32, saturated, then rounded to the cache's format
        k = tl.clamp(k.to(tl.float32) / k_scale, -fp8_max, fp8_max)
        v = tl.clamp(v.to(tl.float32) / v_scale, -fp8_max, fp8_max)
        k = _round_to_fp8(k, MANT_BITS, MIN_NORMAL, SUB_MAGIC).to(key_cache_ptr.dtype.element_ty)
        v = _round_to_fp8(v, MANT_BITS, MIN_NORMAL, SUB_MAGIC).to(value_cache_ptr.dtype.element_ty)
    tl.store(key_cache_ptr + block * kc_s0 + offset * kc_s1 + h * kc_s2 + d * kc_s3, k, mask=mask)
    tl.store(value_cache_ptr + block * vc_s0 + offset * vc_s1 + h * vc_s2 + d * vc_s3, v, mask=mask)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """key, value [num_tokens, num_kv_heads, head_dim] -> key_cache, value_cache
    [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping; in place."""
    check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    reshape_and_cache_unchecked(key, value, key_cache, value_cache, slot_mapping, float(k_scale), float(v_scale))


def reshape_and_cache_unchecked(key, value, key_cache, value_cache, slot_mapping, k_scale: float = 1.0,
                                v_scale: float = 1.0) -> None:
    """The launch alone (no host read-back of slot_mapping's range): for a caller
    that checked the step's slots once (`AttentionMetadata.validate`); capturable
    in a CUDA graph. Slot -1 rows (padding) write nothing."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    # The kernel reads slot i at slot_ptr + i; a strided view would hand it
    # other entries (or memory past the tensor).
    slot_mapping = slot_mapping.contiguous()
    quant = is_fp8(key_cache.dtype)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        num_kv_heads, head_dim, k_scale, v_scale,
        torch.finfo(key_cache.dtype).max if quant else 1.0,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=quant, **_fp8_format(key_cache.dtype),
    )


def _fp8_format(dtype: torch.dtype) -> dict:
    """The rounding constants of an fp8 format (placeholders for other caches): mantissa
    bits, smallest normal, and the fp32 number whose ulp is the smallest subnormal."""
    if not is_fp8(dtype):
        return dict(MANT_BITS=3, MIN_NORMAL=1.0, SUB_MAGIC=1.0)
    fi = torch.finfo(dtype)
    mant = 3 if dtype == torch.float8_e4m3fn else 2
    return dict(MANT_BITS=mant, MIN_NORMAL=fi.smallest_normal, SUB_MAGIC=fi.smallest_normal * 2.0 ** (23 - mant))
