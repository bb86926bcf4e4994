"""Weight-only int8 linear on the CPU: y = (x @ q.T) * scale (+ bias), q int8 [N, K] with one
fp32 scale per output row, x fp32 or bf16, the int8 weight widened in registers.

vLLM counterpart: vLLM's CPU build multiplies int8 weights in C++ (`csrc/cpu/sgl-kernels`'
`int8_scaled_mm_with_quant`, or oneDNN's `onednn_scaled_mm` through
`vllm/model_executor/kernels/linear/scaled_mm/cpu.py`), both W8A8: they quantize the
activations to int8 too. This kernel is weight-only (W8A16): the activations stay in the
model's dtype, so its only error is the weight's rounding.

Why: a decode step multiplies one to a few rows by every weight, so a linear layer is bound by
reading the weight from memory. An int8 weight is a quarter of the bytes of an fp32 one and
half of a bf16 one (and a quarter or half of the memory). Dequantizing first (`q.float() *
scale`, then `F.linear`) would write and read back a full-precision copy on every call and
gain nothing; here each weight byte is read once per block of rows and widened in registers.

Measured (`benchmarks/bench_int8_linear.py`, AMD EPYC Zen 3, AVX2 + FMA, 1 thread, read
bandwidth 19.3 GB/s, Qwen3-0.6B's four linear shapes, weights cycled past the L3): one row
(a decode step of one sequence) 1.07-1.26x the engine's bf16 linear and 1.53-1.90x its fp32
one; 16 rows 0.71-0.80x bf16 and 0.80-1.08x fp32; 256 rows 0.65-0.70x bf16 (40-44 against
61-67 GFLOP/s). The kernel streams 5.7-6.9 G weights/s: it is bound by widening each weight
(load, sign-extend, convert: three instructions per eight weights) on every row, not by
memory, so it wins only where the full-precision matmul is memory-bound with one or two rows.
A kernel that widens a weight block once into registers and applies it to several rows (as
`csrc/cpu_gemm.h` does for bf16) is what 16 rows and prefills would need.

Layout and loops: the weight stays row-major [N, K] (one output per row). The outputs are
taken in blocks of `ROWS_PER_BLOCK` weight rows, split into torch's thread count of ranges
(Python threads around a GIL-free compiled loop; see `_int8_linear_kernel`); for each row of x, one pass over k loads x[m, k] once
and the block's four int8 weights, widened to fp32 in registers, into four vector
accumulators (LLVM vectorises the k loop). The block's 4 x K bytes stay in L1 while the rows
of x pass, so a prefill reads the weight from memory once.

Invariants:
* `int8_linear_reference` is the oracle: fp32 matmul of the widened weight, then the scale,
  then the bias, cast to x's dtype; the kernel differs from it only by fp32 summation order;
* batch invariance: an output's sum runs over k in the same order whatever the number of
  rows (the same loop serves one row and a prefill), so a request's logits do not depend on
  the batch it shares a step with;
* arguments are checked (ValueError naming the argument): x 2-D fp32/bf16 with K columns,
  q int8 [N, K] contiguous, scale fp32 [N], bias None or [N]; nothing is written in place.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

ROWS_PER_BLOCK = 4  # weight rows per pass over x: four accumulators share each load of x
DTYPES = (torch.float32, torch.bfloat16)


@njit(cache=True, nogil=True, fastmath=True)
def _int8_linear_rows(x, q, scale, out, n_begin, n_end):  # pragma: no cover - compiled
    """Outputs [n_begin, n_end) of every row of x; n_begin a multiple of ROWS_PER_BLOCK."""
    m_rows, k = x.shape
    full_end = n_begin + (n_end - n_begin) // ROWS_PER_BLOCK * ROWS_PER_BLOCK
    for n0 in range(n_begin, full_end, ROWS_PER_BLOCK):
        for m in range(m_rows):  # the block's 4 weight rows (4 x K bytes) stay in L1 across the rows of x
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for j in range(k):  # one load of x[m, j] feeds four products
                xv = x[m, j]
                a0 += xv * np.float32(q[n0, j])
                a1 += xv * np.float32(q[n0 + 1, j])
                a2 += xv * np.float32(q[n0 + 2, j])
                a3 += xv * np.float32(q[n0 + 3, j])
            out[m, n0] = a0 * scale[n0]
            out[m, n0 + 1] = a1 * scale[n0 + 1]
            out[m, n0 + 2] = a2 * scale[n0 + 2]
            out[m, n0 + 3] = a3 * scale[n0 + 3]
    for r in range(full_end, n_end):  # the last N % 4 rows
        for m in range(m_rows):
            acc = np.float32(0.0)
            for j in range(k):
                acc += x[m, j] * np.float32(q[r, j])
            out[m, r] = acc * scale[r]


_POOL: list[ThreadPoolExecutor] = []  # made on the first call with more than one thread


def _int8_linear_kernel(x, q, scale, out) -> None:
    """All outputs, split into torch.get_num_threads() ranges of whole blocks run on Python
    threads (the compiled loop releases the GIL). Not a numba prange: in an engine core forked
    from a process that used GNU OpenMP, numba's OpenMP layer refuses to start a parallel
    region ("fork() called from a process already using GNU OpenMP") and leaves the output
    unwritten; plain threads are safe there."""
    n = q.shape[0]
    threads = min(torch.get_num_threads(), max(1, n // (64 * ROWS_PER_BLOCK)))
    if threads == 1:
        _int8_linear_rows(x, q, scale, out, 0, n)
        return
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="int8_linear"))
    step = -(-n // threads // ROWS_PER_BLOCK) * ROWS_PER_BLOCK
    jobs = [_POOL[0].submit(_int8_linear_rows, x, q, scale, out, b, min(b + step, n)) for b in range(step, n, step)]
    _int8_linear_rows(x, q, scale, out, 0, min(step, n))
    for job in jobs:
        job.result()


def _check(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"q must be a 2-D int8 weight [N, K], got {q.dtype} of shape {tuple(q.shape)}")
    n, k = q.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be 2-D with K={k} columns, got shape {tuple(x.shape)}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (n,):
        raise ValueError(f"scale must be fp32 of shape ({n},), got {scale.dtype} {tuple(scale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be None or of shape ({n},), got {tuple(bias.shape)}")


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle (any device, any float dtype): (x @ q.T) in fp32, times the row scales, plus
    the bias, cast to x's dtype."""
    _check(x.reshape(-1, x.shape[-1]), q, scale, bias)
    out = torch.matmul(x.float(), q.float().t()) * scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def handles(x: torch.Tensor) -> bool:
    """Does the compiled kernel take x: a CPU tensor of fp32 or bf16, no autograd graph?"""
    return (x.device.type == "cpu" and x.dtype in DTYPES
            and not (torch.is_grad_enabled() and x.requires_grad))


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (q * scale[:, None]).T (+ bias), in x's dtype; the compiled
    kernel where `handles(x)`, else the reference."""
    if not handles(x):
        return int8_linear_reference(x, q, scale, bias)
    rows = x.reshape(-1, x.shape[-1])
    _check(rows, q, scale, bias)
    if not q.is_contiguous():
        raise ValueError("q must be contiguous (row-major [N, K])")
    xf = rows.float().contiguous()  # bf16 rows widened once: a decode's x is a few KB
    out = torch.empty((rows.shape[0], q.shape[0]), dtype=torch.float32)
    _int8_linear_kernel(xf.numpy(), q.numpy(), scale.numpy(), out.numpy())
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], q.shape[0])
