"""Fused CPU layer ops for fp32 and bf16 models: RMSNorm (alone and after the
residual add), SiLU-and-mul, the neox rotary embedding, and Qwen3's per-head
q/k norms with the rotation (`qk_norm_rope`), each one compiled loop (the bf16
loops, rounded where torch rounds, are in `cpu_layer_ops_bf16.py`).

vLLM counterpart: `csrc/cpu/layernorm.cpp` (`rms_norm`, `fused_add_rms_norm`),
`csrc/cpu/activation.cpp` (`silu_and_mul`) and `csrc/cpu/pos_encoding.cpp`
(`rotary_embedding`), which vLLM's CPU build registers as torch ops and its
layers call instead of chains of elementwise torch ops.

Why: written with torch ops, RMSNorm is six passes over the hidden state (add,
pow, mean, rsqrt, two multiplies), SiLU-and-mul three, the rotation of q and k
about ten (index, cast, chunk, four multiplies, add, sub, cat), each reading
and writing a full tensor. Here each op reads its inputs once and writes its
outputs once. `benchmarks/bench_engine_layer_ops.py` times both versions
side by side; on the 2-core machine, tiny-py-target's shapes, torch -> fused
for a 2,048-token prefill: add + RMSNorm 0.37 -> 0.16 ms on one thread, 0.16
-> 0.09 ms on two; SiLU-and-mul 1.23 -> 0.84 and 0.62 -> 0.42 ms; rotary of q
0.69 -> 0.59 and 0.35 -> 0.30 ms; on a 128-token decode step 1.04-1.7x.

The reference for each op is the torch code it replaces, kept in
`mini_vllm.models.layers` / `rotary` as the path for bf16, fp16, autograd and
GPUs; the tests compare the two on random shapes.

Contract (the callers in `mini_vllm.models` check dtype and device; these
functions check shapes and contiguity, and raise ValueError naming the argument):
* every tensor is float32 on the CPU, or every one bfloat16 (the rotary
  tables stay fp32), rows contiguous (a row is one token);
* outputs are new tensors; no input is written;
* RMSNorm sums the squares in fp32 in a different order from torch's mean
  (vectorised partial sums), so it agrees to a few fp32 ulps, not bit for bit;
  the rotation's products and sums are rounded as torch rounds them (no fused
  multiply-add), so it agrees exactly;
* `rotary_embedding` raises IndexError for a position outside the cos/sin table.

Two implementations of each loop: the numba loops below (the reference on every
CPU) and C++ ops (`cpu_layer_ops_native.py`, `csrc/cpu_layer_ops.cpp`), which run
where the C++ attention kernel runs (AVX-512 with BF16, or AVX2 + FMA: two builds of
one source, `cpu_native.isa()`). The public functions check and allocate once,
then call one or the other. The C++ call exists for the decode step: 112 calls a step
on a Qwen3-0.6B-shaped model, each a few microseconds of arithmetic, where numba's
dispatch and thread wake-up cost more than the loop (bench_engine_layer_ops.py times
the two: 1.5-1.8x faster for a decode step's norms and q/k rotation, equal for SiLU).

Threads: as many as torch uses, the rows split evenly between them (a prange;
`use_torch_threads` sets the count before each call; the C++ ops split only calls
of `cpu_layer_ops_native.SPLIT_ELEMENTS` values or more). The team is torch's own
(see "Threads" in cpu_runtime.py), already awake from the op before,
and the split costs little: on one thread a call takes about 2 us more than
a plain loop's; on two threads a 128-token SiLU-and-mul takes 19 instead of
35 us, a 2,048-token one 0.33 instead of 0.93 ms. One thread per op, as these
were first written, left the second core idle: 0.8-0.9x torch's two-thread
ops on a prefill.
"""
from __future__ import annotations

import numpy as np
import torch

from numba import njit, prange

from . import cpu_layer_ops_bf16 as bf16
from . import cpu_layer_ops_native as native
from .cpu_layer_ops_bf16 import _check_positions
from .cpu_paged_attention import _FASTMATH, _exp
from .cpu_runtime import use_torch_threads


@njit(cache=True, inline="always", fastmath=_FASTMATH, error_model="numpy")
def _norm_row(x, weight, eps, out):
    """out = weight * x / sqrt(mean(x^2) + eps), for one row (1-D views)."""
    hidden = x.shape[0]
    ss = np.float32(0.0)
    for j in range(hidden):
        ss += x[j] * x[j]
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(hidden) + eps)
    for j in range(hidden):
        out[j] = weight[j] * (x[j] * inv)


# Each op is one prange over rows (tokens): numba splits the rows into one equal
# slice per thread. A row's arithmetic is the same whichever thread does it.
# The inner loops index 1-D views of a row (or of one head): with 2-D indexing
# (`x[t, base + j]`) LLVM kept the rotary loop scalar, 2.7 ns an element on a
# 1,259-token bf16 prefill; on the head's view it vectorises, 0.45 ns.

@njit(cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def _rms_norm_rows(x, weight, eps, out):
    for r in prange(x.shape[0]):
        _norm_row(x[r], weight, eps, out[r])


@njit(cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def _add_rms_norm_rows(x, residual, weight, eps, out, residual_out):
    for r in prange(x.shape[0]):
        xr, rr, sr = x[r], residual[r], residual_out[r]
        for j in range(xr.shape[0]):
            sr[j] = xr[j] + rr[j]
        _norm_row(sr, weight, eps, out[r])  # the row is still in L1: no second trip to memory


@njit(cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def _silu_and_mul_rows(x, out):
    rows, inter = out.shape
    one = np.float32(1.0)
    for r in prange(rows):
        gate, up, o = x[r, :inter], x[r, inter:], out[r]
        for j in range(inter):
            g = gate[j]
            o[j] = g / (one + _exp(-g)) * up[j]


@njit(cache=True, inline="always", error_model="numpy")
def _rotate_head(x1, x2, cos, sin, o1, o2):
    """One head's neox rotation: (x1*cos - x2*sin, x2*cos + x1*sin), each product
    rounded before the sum (callers compile without fastmath, so no fused multiply-add)."""
    for j in range(x1.shape[0]):
        o1[j] = x1[j] * cos[j] - x2[j] * sin[j]
        o2[j] = x2[j] * cos[j] + x1[j] * sin[j]


@njit(cache=True, parallel=True, error_model="numpy")  # no fastmath: products rounded before the sum, as torch
def _rope_rows(positions, x, cos_cache, sin_cache, head_size, out):
    tokens, width = x.shape
    half = head_size // 2
    _check_positions(positions, cos_cache.shape[0])
    for t in prange(tokens):
        cos, sin = cos_cache[positions[t]], sin_cache[positions[t]]
        for base in range(0, width, head_size):
            _rotate_head(x[t, base:base + half], x[t, base + half:base + head_size], cos, sin,
                         out[t, base:base + half], out[t, base + half:base + head_size])


# The norm of one head, compiled on its own with fastmath (its sum of squares vectorised,
# as in _rms_norm_rows), for callers that compile without it.
_norm_head = njit(cache=True, fastmath=_FASTMATH, error_model="numpy")(_norm_row.py_func)


@njit(cache=True, inline="always", error_model="numpy")
def _norm_rotate_heads(src, weight, eps, cos, sin, normed, dst):
    """dst = each head of src (one token's q or k) normed with `weight`, then rotated;
    `normed` is the caller's scratch for one head."""
    head_size = normed.shape[0]
    half = head_size // 2
    for a in range(0, src.shape[0], head_size):
        _norm_head(src[a:a + head_size], weight, eps, normed)
        _rotate_head(normed[:half], normed[half:], cos, sin, dst[a:a + half], dst[a + half:a + head_size])


@njit(cache=True, parallel=True, error_model="numpy")  # no fastmath: the rotation rounds as torch
def _qk_norm_rope_rows(positions, qkv, q_heads, k_heads, head_size, q_weight, k_weight, eps, cos_cache,
                       sin_cache, q_out, k_out):
    _check_positions(positions, cos_cache.shape[0])
    for t in prange(qkv.shape[0]):
        cos, sin = cos_cache[positions[t]], sin_cache[positions[t]]
        normed = np.empty(head_size, np.float32)
        q_end = q_heads * head_size
        _norm_rotate_heads(qkv[t, :q_end], q_weight, eps, cos, sin, normed, q_out[t])
        _norm_rotate_heads(qkv[t, q_end:q_end + k_heads * head_size], k_weight, eps, cos, sin, normed, k_out[t])


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """The numba ops' view of a checked tensor: float32, or bf16 as its raw bits (uint16)."""
    # The shortest chain of views: 1.3 us for a bf16 row block against 3.1 us for
    # detach / int16 / numpy / uint16.
    if t.requires_grad:
        t = t.detach()
    return t.numpy() if t.dtype == torch.float32 else t.view(torch.uint16).numpy()


_DTYPES = (torch.float32, torch.bfloat16)


def _rows(name: str, t: torch.Tensor, width: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A [rows, width] view of `t` with contiguous rows (any row stride); `dtype`: the
    dtype it must have. Checked with tensor attributes only: they are read on every call."""
    if t.dtype not in _DTYPES or (dtype is not None and t.dtype != dtype) or not t.is_cpu:
        raise ValueError(f"{name} must be a {'float32 or bfloat16' if dtype is None else dtype} CPU tensor, "
                         f"got {t.dtype} on {t.device}")
    a = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])  # a copy only where a view cannot be
    if (a.stride(1) != 1 and a.shape[1] > 1) or (width is not None and a.shape[1] != width):
        raise ValueError(f"{name} must be [tokens, {width or 'width'}] with contiguous rows, "
                         f"got shape {tuple(t.shape)} and strides {t.stride()}")
    return a


def _vector(name: str, t: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A [width] contiguous vector (a norm's weight) of x's dtype."""
    if t.dtype != dtype or not t.is_cpu or t.shape != (width,) or t.stride(0) != 1:
        raise ValueError(f"{name} must be a contiguous {dtype} CPU vector of {width}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t


def _like(a: torch.Tensor) -> torch.Tensor:
    """A new [rows, width] tensor with a's shape and dtype, rows contiguous (uninitialised:
    every op writes its outputs whole). The cheapest allocation torch offers: 1 us, against
    2.5 us for torch.empty(shape, dtype=...), and outputs stay 2-D unless x was not."""
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _shaped(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out [rows, width] viewed with x's leading dims (a view costs 1-2.5 us: only when needed)."""
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def _positions(positions: torch.Tensor, tokens: int) -> torch.Tensor:
    if positions.shape != (tokens,):
        raise ValueError(f"positions must be [{tokens}], one per token, got {tuple(positions.shape)}")
    return positions.to(torch.int64).contiguous()  # no copy for the engine's int64 positions


# Each function checks its arguments, allocates its outputs (torch.empty: every element is
# written), then runs the C++ op (cpu_layer_ops_native.py, where it can run) or the numba loop
# on numpy views. Both write the same rounding points; the C++ call costs a few microseconds
# where numba's dispatch and thread wake-up cost tens (see that module).

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim; x [..., H], weight [H]."""
    hidden = weight.shape[0]
    xs, w = _rows("x", x, hidden), _vector("weight", weight, hidden, x.dtype)
    out = _like(xs)
    if native.handles(x.dtype):
        native.rms_norm(xs, w, eps, out)
    else:
        use_torch_threads()
        loop = _rms_norm_rows if x.dtype == torch.float32 else bf16.rms_norm_rows_bf16
        loop(_as_numpy(xs), _as_numpy(w), np.float32(eps), _as_numpy(out))
    return _shaped(out, x)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the residual stream's add and the
    next norm in one pass; x and residual [T, H]."""
    hidden = weight.shape[0]
    xs, rs = _rows("x", x, hidden), _rows("residual", residual, hidden, x.dtype)
    if xs.shape != rs.shape:
        raise ValueError(f"x and residual must have one shape, got {tuple(x.shape)} and {tuple(residual.shape)}")
    w = _vector("weight", weight, hidden, x.dtype)
    out, res_out = _like(xs), _like(xs)
    if native.handles(x.dtype):
        native.fused_add_rms_norm(xs, rs, w, eps, out, res_out)
    else:
        use_torch_threads()
        loop = _add_rms_norm_rows if x.dtype == torch.float32 else bf16.add_rms_norm_rows_bf16
        loop(_as_numpy(xs), _as_numpy(rs), _as_numpy(w), np.float32(eps), _as_numpy(out), _as_numpy(res_out))
    return _shaped(out, x), _shaped(res_out, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] [T, 2I] -> silu(gate) * up [T, I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be even ([gate | up]), got {tuple(x.shape)}")
    xs = _rows("x", x)
    out = torch.empty(xs.shape[0], xs.shape[1] // 2, dtype=x.dtype)
    if native.handles(x.dtype):
        native.silu_and_mul(xs, out)
    else:
        use_torch_threads()
        loop = _silu_and_mul_rows if x.dtype == torch.float32 else bf16.silu_and_mul_rows_bf16
        loop(_as_numpy(xs), _as_numpy(out))
    return _shaped(out, x)


def _rotary_tables(cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_size: int):
    return (_rows("cos_cache", cos_cache, head_size // 2, torch.float32),
            _rows("sin_cache", sin_cache, head_size // 2, torch.float32))


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """Rotate each head of x [T, heads * head_size] by its token's position (neox
    halves), with fp32 cos/sin tables [max_position, head_size / 2]."""
    if x.dim() != 2 or x.shape[1] % head_size or head_size % 2:
        raise ValueError(f"x must be [tokens, heads * head_size] with an even head_size {head_size}, "
                         f"got {tuple(x.shape)}")
    pos = _positions(positions, x.shape[0])
    xs = _rows("x", x)
    cos, sin = _rotary_tables(cos_cache, sin_cache, head_size)
    out = _like(xs)
    if native.handles(x.dtype) and head_size <= native.MAX_HEAD_SIZE:
        native.rotary_embedding(pos, xs, cos, sin, head_size, out)
        return out
    use_torch_threads()
    loop = _rope_rows if x.dtype == torch.float32 else bf16.rope_rows_bf16
    loop(pos.numpy(), _as_numpy(xs), cos.numpy(), sin.numpy(), head_size, _as_numpy(out))
    return out


def qk_norm_rope(positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k followed by the rotary embedding, read straight
    from the projection's output qkv [T, (H + 2 * KVH) * D]; returns q [T, H * D] and
    k [T, KVH * D] (new tensors), equal to `rms_norm` of each head then `rotary_embedding`.
    One call and one pass instead of two copies (the heads of a column slice) and four calls."""
    width = (num_heads + 2 * num_kv_heads) * head_size
    if head_size % 2:
        raise ValueError(f"head_size must be even, got {head_size}")
    xs = _rows("qkv", qkv, width)
    pos = _positions(positions, xs.shape[0])
    q_w = _vector("q_weight", q_weight, head_size, qkv.dtype)
    k_w = _vector("k_weight", k_weight, head_size, qkv.dtype)
    cos, sin = _rotary_tables(cos_cache, sin_cache, head_size)
    q_out = torch.empty(xs.shape[0], num_heads * head_size, dtype=qkv.dtype)
    k_out = torch.empty(xs.shape[0], num_kv_heads * head_size, dtype=qkv.dtype)
    if native.handles(qkv.dtype) and head_size <= native.MAX_HEAD_SIZE:
        native.qk_norm_rope(pos, xs, num_heads, num_kv_heads, head_size, q_w, k_w, eps, cos, sin, q_out, k_out)
        return q_out, k_out
    use_torch_threads()
    loop = _qk_norm_rope_rows if qkv.dtype == torch.float32 else bf16.qk_norm_rope_rows_bf16
    loop(pos.numpy(), _as_numpy(xs), num_heads, num_kv_heads, head_size, _as_numpy(q_w), _as_numpy(k_w),
         np.float32(eps), cos.numpy(), sin.numpy(), _as_numpy(q_out), _as_numpy(k_out))
    return q_out, k_out
