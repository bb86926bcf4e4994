"""The C++ fused layer ops (`csrc/cpu_layer_ops.cpp`): the parameter block, the call, the
split between threads.

vLLM counterpart: the CPU build's `_C` ops `rms_norm`, `fused_add_rms_norm`,
`silu_and_mul` and `rotary_embedding` (csrc/cpu/), which its layers call through
torch.ops.

Why: on a decode step each op is a few microseconds of arithmetic on 16 rows, and the
engine makes four per layer. What a call costs is the call: numba's dispatcher types
every argument and its parallel loop wakes the thread team each time. Here a call is one
ctypes call with a pointer to an int64 parameter block, on the calling thread; an op over
`SPLIT_ELEMENTS` values or more (a prefill) is split into one row range per thread by
numba's prange, as the attention kernel's items are (`cpu_native._fan_out`).

Where it runs (`handles`): where the C++ attention kernel runs (`cpu_native.unavailable_reason`
is None: AVX-512 with BF16 or AVX2 with FMA, a compiler, MINI_VLLM_CPU_ATTN not `numba`), in
the build `cpu_native.isa()` picks, outside `cpu_native.numba_only()`, for fp32 and bf16
rows. Elsewhere the numba ops of cpu_layer_ops.py run; they stay the reference the tests hold
these to, bit for bit where the rounding points allow (everything but a norm's sum of squares).

The callers (cpu_layer_ops.py's public functions) have checked dtypes, shapes and strides;
these functions only pack pointers. Every output is written whole, so it may be allocated
uninitialised.
"""
from __future__ import annotations

import struct
import threading

import numpy as np
import torch
from numba import njit, prange, types

from . import cpu_native
from .cpu_runtime import use_torch_threads

# The parameter block's slots, in the order of `enum Param` in the C++ file.
PARAMS = ("op", "dtype", "rows", "width", "x", "x_stride", "residual", "residual_stride", "weight", "eps_bits",
          "out", "residual_out", "positions", "cos", "sin", "cos_stride", "sin_stride", "table_rows", "head_size",
          "q_heads", "k_heads", "k_weight", "k_out", "in_features", "bias")
RMS_NORM, ADD_RMS_NORM, SILU_AND_MUL, ROPE, QK_NORM_ROPE, LINEAR = range(6)  # `enum Op`
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_SIZE = 512  # kMaxHeadSize: the rotations' scratch is on the stack
# Below this many values an op runs on the calling thread. A split costs about 2.5 us
# (the team is awake from the linear before); it paid for a decode step's SiLU-and-mul
# and q/k rotation (16 x 3,072 values) and not for its norms (16 x 1,024).
SPLIT_ELEMENTS = 1 << 15
# A linear splits its output panels between threads from this many multiply-adds (about
# 10 us of one core's work, four times what the split costs).
SPLIT_MACS = 1 << 20
PANEL_COLUMNS = 32  # kPanelColumns of csrc/cpu_gemm.h

_ERRORS = {1: (IndexError, "rotary_embedding: a position is outside the cos/sin table"),
           2: (ValueError, f"head_size over {MAX_HEAD_SIZE}, the most the C++ rotation takes")}


def handles(dtype: torch.dtype) -> bool:
    """Do the C++ ops run for tensors of this dtype here (see the module docstring)?"""
    return (not cpu_native._numba_only_depth and dtype in DTYPES
            and cpu_native.layer_ops_library(len(PARAMS)) is not None)


# Each build's worker, by name (numba binds an external function by its symbol).
_WORKER_TYPE = types.void(types.intp, types.int64, types.int64)
_worker_avx512 = types.ExternalFunction("mini_vllm_layer_op_worker_avx512", _WORKER_TYPE)
_worker_avx2 = types.ExternalFunction("mini_vllm_layer_op_worker_avx2", _WORKER_TYPE)


@njit(cache=True, parallel=True)
def _fan_out_avx512(params, nthreads):
    """Worker w of nthreads computes its slice of the rows (the rows split evenly)."""
    for w in prange(nthreads):
        _worker_avx512(params.ctypes.data, w, nthreads)


@njit(cache=True, parallel=True)
def _fan_out_avx2(params, nthreads):
    """As _fan_out_avx512, for the AVX2 build."""
    for w in prange(nthreads):
        _worker_avx2(params.ctypes.data, w, nthreads)


_FAN_OUT = {"avx512": _fan_out_avx512, "avx2": _fan_out_avx2}


def _eps_bits(eps: float) -> int:
    return struct.unpack("<q", struct.pack("<d", eps))[0]


class _ParamBlock(threading.local):
    """Each thread's parameter block, allocated once with its address: filling it costs
    0.5 us where a new array and its ctypes address cost 1.7 us."""

    def __init__(self) -> None:
        self.params = np.zeros(len(PARAMS), np.int64)
        self.address = self.params.ctypes.data


_block = _ParamBlock()


def _run(slots: tuple, work: int, split_at: int = SPLIT_ELEMENTS) -> None:
    block = _block
    block.params[:] = slots
    lib = cpu_native.layer_ops_library(len(PARAMS))
    split = work >= split_at and torch.get_num_threads() > 1
    status = lib.layer_op(block.address, 0 if split else 1)
    if status:
        error, message = _ERRORS[status]
        raise error(message)
    if split:
        _FAN_OUT[lib.isa](block.params, use_torch_threads())


def op_block(**slots: int) -> np.ndarray:
    """A parameter block with the named slots (PARAMS' names) filled and the others zero, for a
    caller that fills a block once and runs it on every step (`models/cpu_step.py`)."""
    params = np.zeros(len(PARAMS), np.int64)
    for name, value in slots.items():
        params[PARAMS.index(name)] = value
    return params


def eps_slot(eps: float) -> int:
    """The `eps_bits` slot's value: eps's float64 bits as an int64."""
    return _eps_bits(eps)


def raise_status(status: int) -> None:
    """Raise what a nonzero `layer_op` status means (as `_run` does)."""
    error, message = _ERRORS[status]
    raise error(message)


def fan_out(params: np.ndarray, nthreads: int) -> None:
    """Split a checked block's rows between `nthreads` threads (as `_run` does for a large op)."""
    _FAN_OUT[cpu_native.layer_ops_library(len(PARAMS)).isa](params, nthreads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    rows, width = x.shape
    _run((RMS_NORM, DTYPES[x.dtype], rows, width, x.data_ptr(), x.stride(0), 0, 0, weight.data_ptr(),
          _eps_bits(eps), out.data_ptr(), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), rows * width)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: torch.Tensor, residual_out: torch.Tensor) -> None:
    rows, width = x.shape
    _run((ADD_RMS_NORM, DTYPES[x.dtype], rows, width, x.data_ptr(), x.stride(0), residual.data_ptr(),
          residual.stride(0), weight.data_ptr(), _eps_bits(eps), out.data_ptr(), residual_out.data_ptr(),
          0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), rows * width)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor) -> None:
    rows, inter = out.shape
    _run((SILU_AND_MUL, DTYPES[x.dtype], rows, inter, x.data_ptr(), x.stride(0), 0, 0, 0, 0, out.data_ptr(),
          0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), rows * inter)


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                     head_size: int, out: torch.Tensor) -> None:
    rows, width = x.shape
    _run((ROPE, DTYPES[x.dtype], rows, width, x.data_ptr(), x.stride(0), 0, 0, 0, 0, out.data_ptr(), 0,
          positions.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(), cos_cache.stride(0),
          sin_cache.stride(0), cos_cache.shape[0], head_size, 0, 0, 0, 0, 0, 0), rows * width)


def qk_norm_rope(positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor) -> None:
    rows = qkv.shape[0]
    _run((QK_NORM_ROPE, DTYPES[qkv.dtype], rows, 0, qkv.data_ptr(), qkv.stride(0), 0, 0, q_weight.data_ptr(),
          _eps_bits(eps), q_out.data_ptr(), 0, positions.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(),
          cos_cache.stride(0), sin_cache.stride(0), cos_cache.shape[0], head_size, num_heads, num_kv_heads,
          k_weight.data_ptr(), k_out.data_ptr(), 0, 0), rows * (num_heads + num_kv_heads) * head_size)


def handles_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does `linear` take this product here: the C++ library runs for x's dtype, the weight's
    rows fill whole panels (and in bf16 its row length is even: pairs of inputs), x's rows
    are unit-stride?"""
    return (handles(x.dtype) and weight.dim() == 2 and weight.shape[0] % PANEL_COLUMNS == 0
            and (x.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0) and x.stride(-1) == 1)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """The layout of csrc/cpu_gemm.h: bf16 [N/32 panels][K/2 pairs][32 columns][2];
    fp32 [N/32 panels][K][32 columns]."""
    n, k = weight.shape
    w = weight.detach()
    if w.dtype == torch.bfloat16:
        return w.reshape(n // PANEL_COLUMNS, PANEL_COLUMNS, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.reshape(n // PANEL_COLUMNS, PANEL_COLUMNS, k).permute(0, 2, 1).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [rows, N] = x [rows, K] @ W.T (+ bias): packed by pack_linear_weight, bias fp32, out
    of x's dtype."""
    rows, k = x.shape
    n = out.shape[1]
    _run((LINEAR, DTYPES[x.dtype], rows, n, x.data_ptr(), x.stride(0), 0, 0, packed.data_ptr(), 0, out.data_ptr(),
          0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, k, 0 if bias is None else bias.data_ptr()), rows * n * k, SPLIT_MACS)
