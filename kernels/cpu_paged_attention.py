"""CPU paged attention compiled with numba: the engine's varlen batch, read in place.

vLLM counterparts: the CPU attention backend `vllm/v1/attention/backends/cpu_attn.py`
and its C++ kernels `csrc/cpu/cpu_attn.cpp` / `cpu_attn_impl.hpp`. Same signatures
and errors as Chapter 1's PyTorch reference (`mini_vllm.paged_attention`) and
the Triton kernels beside this file.

Why a compiled kernel on the CPU: the "torch" backend first copies every
sequence's blocks into a padded tensor, then reads that copy again in one
SDPA call. This kernel walks each sequence's block table and reads K/V rows
where they lie in the cache, once per query tile, with an online softmax
(running max, running sum, fp32 accumulator), as Chapter 1's lesson and the
Triton kernel do.

Work split: one work item is (sequence, KV head, tile of up to
`TILE_ROWS // group` query tokens). A decode is one item per KV head; a long
prefill is cut into tiles so two cores share it. Items run in a `prange`
handed out one at a time (chunk size 1), longest first, so ragged batches end
balanced. An item stacks its query tokens x the `group` query heads of its KV
head (GQA) into the rows of a query tile Q, so each K/V row is widened once
and used by all of them.

One item, FlashAttention's loop: the sequence's keys are taken a step at a
time, several cache blocks per step (K and V tiles of `KV_TILE_BYTES` each),
and per step

    S   = Q @ K_step.T                 one matrix product, rows x keys
    P   = exp(S - running max)         keys in a row's future get P = 0
    acc = acc * alpha + P @ V_step     alpha = exp(old max - new max)

The two products are BLAS calls (numba compiles `np.dot` on float32 arrays to
sgemm from scipy's OpenBLAS), the softmax between them is plain loops. The
same code serves a decode (1 to `group` rows) and a prefill tile (64 rows).

Invariants:
- only positions < seq_len are read: an item's last key is its last query's
  position, so -1 table entries, unused blocks and NaN slots past seq_len are
  never touched (a masked key's P is 0, but 0 * NaN would still be NaN);
- query t of a sequence sits at position seq_len - q_len + t and sees keys
  0 .. that position; key 0 is in the first step and visible to every row, so
  each row's running max is finite from the first step on.

Arithmetic: fp32 scores, softmax and accumulators. The caches are read as raw
bits (fp32 as uint32, bf16 and fp16 as uint16; numba has no bf16 or CPU fp16
type) and each K/V block is widened into an fp32 tile: bf16 by shifting its
16 bits into the top of an fp32, fp16 by the exponent rebias below. exp of
the scores is a polynomial the compiler vectorises (`_exp`, relative error
under 1e-7). The output is fp32 and cast to the query's dtype by torch (round to
nearest even). `fastmath` allows only reassociation and fused multiply-add,
so loops vectorise while -inf and NaN keep IEEE meaning; numpy's error model
makes a division by zero give inf/NaN (as in torch) instead of raising from
a thread.

Threads: as many as torch uses (`torch.set_num_threads`, OMP_NUM_THREADS), so
one setting governs both. BLAS is held to one thread while the kernel runs
(`_single_threaded_blas`): numba's threads are the parallelism, and an
OpenBLAS that split each product again would put 2 x 2 threads on 2 cores.

Compile: once per cache width (uint32 for fp32, uint16 for bf16 and fp16) on
first use, about 5 to 6 s of CPU each (7 to 8 s wall on a busy 2-core
machine; the BLAS bindings add about 1 s), then loaded from numba's on-disk
cache in under half a second (`cache=True`: `__pycache__` beside this file,
or NUMBA_CACHE_DIR where that is read-only; `benchmarks/bench_engine_attention.py`
prints both).
"""
from __future__ import annotations

import contextlib
import os
import tempfile

import numpy as np
import torch

from .paged_checks import check_cu_seqlens_q, check_paged_attention_args, check_query
from .validation import check_kv_cache, check_num_heads


def _writable_cache_dir() -> None:
    """numba caches beside the source; where that is read-only (an installed
    package) and no NUMBA_CACHE_DIR is set, use a per-user temp folder rather
    than fail at import."""
    here = os.path.dirname(os.path.abspath(__file__))
    if "NUMBA_CACHE_DIR" not in os.environ and not os.access(here, os.W_OK):
        os.environ["NUMBA_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"mini_vllm_numba_{os.getuid()}")


def _thread_pool_size() -> None:
    """numba sizes its thread pool once, at import, from the CPUs this process
    may use at that moment. A process that is pinned to one core when the
    kernel is first imported and widened later (a benchmark's 1-thread phase,
    then its 2-thread phase) would keep a 1-thread pool for good. So the pool
    gets every CPU of the machine; each call still uses only as many threads
    as torch does."""
    if "NUMBA_NUM_THREADS" not in os.environ:
        os.environ["NUMBA_NUM_THREADS"] = str(os.cpu_count() or 1)


_writable_cache_dir()
_thread_pool_size()

import numba  # noqa: E402  (after the cache dir and pool size are settled: numba reads them at import)
import scipy.linalg.cython_blas  # noqa: E402, F401  (the BLAS numba's np.dot calls: loaded before we limit it)
from numba import njit, prange  # noqa: E402

FMT_FP32, FMT_BF16, FMT_FP16 = 0, 1, 2
_FORMATS = {torch.float32: FMT_FP32, torch.bfloat16: FMT_BF16, torch.float16: FMT_FP16}
# Query rows (tokens x heads of a group) per work item: 64 rows x head_dim 128
# of fp32 accumulators is 32 KiB. Measured against 32, 128 and 256 rows: 64 is
# as fast as any on prefills of 64-512 tokens (128 and 256 lose up to 25% on
# short prefills, whose last tile is mostly empty).
TILE_ROWS = 64
# Keys per softmax step: as many as fill a 32 KiB fp32 tile (128 keys at
# head_dim 64, 64 at 128), rounded down to whole cache blocks: larger matrix
# products and fewer rescales than one 16-key block per step, 10% faster on a
# 512-token prefill (20.1 -> 18.1 ms at head_dim 128); 64 KiB tiles measured
# within 8% either way.
KV_TILE_BYTES = 32 << 10
_FASTMATH = {"reassoc", "contract"}
_TWO_POW_112 = np.float32(2.0 ** 112)
_NEG_INF = np.float32(-np.inf)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)  # ln 2 = HI + LO, HI exact in 9 bits


@njit(cache=True)
def _fp16_to_fp32(h):
    """IEEE half bits -> float32. Moving the 15 exponent+mantissa bits up by 13
    gives a float32 whose exponent is biased by 15 instead of 127; multiplying
    by 2**112 rebiases it (subnormal halves come out exact too). Inf/NaN
    (exponent all ones) keep their mantissa and get float32's all-ones exponent."""
    h = np.uint32(h)
    bits = np.uint32(((h & 0x8000) << 16) | ((h & 0x7FFF) << 13))
    if (h & 0x7C00) == 0x7C00:
        return np.uint32(bits | 0x7F800000).view(np.float32)
    return bits.view(np.float32) * _TWO_POW_112


@njit(cache=True, inline="always", fastmath=_FASTMATH, error_model="numpy")
def _exp(x):
    """exp(x) in fp32, for x clamped to [-87, 88] (where exp is a normal fp32).
    Why not np.exp: numba calls libm's expf once per element, so the softmax
    loop (max, exp, sum) takes 2.9 ns a score here; this is plain arithmetic,
    the loop vectorises and takes 0.8 ns (a 512-token prefill at head_dim 128:
    23 -> 18 ms). exp(x) =
    2**n * exp(r) with n = round(x / ln 2) and |r| <= ln(2) / 2: exp(r) is
    Cephes' degree-7 polynomial (relative error < 1e-7), 2**n is n + 127
    written into a float's exponent bits. Scores minus the running max are
    <= 0; below -87 it returns exp(-87) ~ 2e-38 instead of a smaller number,
    nothing next to a row sum >= 1."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO  # in two parts so r keeps its low bits
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * np.uint32((np.int32(n) + 127) << 23).view(np.float32)


@njit(cache=True)
def _widen_block(cache, phys, kvh, n, fmt, tile):
    """tile[:n] = rows 0..n-1 of KV head kvh in physical block phys, as fp32.
    The format branch sits outside the loops so each loop vectorises."""
    head_dim = tile.shape[1]
    if fmt == FMT_FP32:
        for j in range(n):
            for d in range(head_dim):
                tile[j, d] = np.uint32(cache[phys, j, kvh, d]).view(np.float32)
    elif fmt == FMT_BF16:  # bf16 is the top half of an fp32
        for j in range(n):
            for d in range(head_dim):
                tile[j, d] = np.uint32(np.uint32(cache[phys, j, kvh, d]) << 16).view(np.float32)
    else:
        for j in range(n):
            for d in range(head_dim):
                tile[j, d] = _fp16_to_fp32(cache[phys, j, kvh, d])


@njit(cache=True, fastmath=_FASTMATH, error_model="numpy")
def _attend_item(query, key_cache, value_cache, out, table_row, seq_len, q_start, q_len, t0, t1, kvh,
                 group, fmt, scale, step_keys, q_tile, acc, m, l, alpha, s_buf, pv_buf, k_tile, v_tile):
    """Query tokens t0..t1-1 of one sequence x the group of KV head kvh, over
    the sequence's keys, step_keys at a time, with an online softmax. Scratch
    arrays are the calling thread's own."""
    head_dim = query.shape[2]
    block_size = key_cache.shape[1]
    context_len = seq_len - q_len  # query t sits at position context_len + t
    rows = (t1 - t0) * group
    for r in range(rows):  # row r = token t0 + r // group, head kvh * group + r % group
        tok, head = q_start + t0 + r // group, kvh * group + r % group
        for d in range(head_dim):
            q_tile[r, d] = query[tok, head, d] * scale
            acc[r, d] = 0.0
        m[r] = _NEG_INF
        l[r] = 0.0
    q = q_tile[:rows]
    # np.dot(a, b, out) needs a contiguous out of the exact shape: views of flat buffers.
    pv = pv_buf[:rows * head_dim].reshape((rows, head_dim))
    kv_end = context_len + t1  # the item's last query sees keys up to context_len + t1 - 1
    for start in range(0, kv_end, step_keys):
        n = min(step_keys, kv_end - start)  # never a slot at or past kv_end <= seq_len
        for c in range(0, n, block_size):  # step_keys is a multiple of block_size
            phys = table_row[(start + c) // block_size]
            keys = min(block_size, n - c)
            _widen_block(key_cache, phys, kvh, keys, fmt, k_tile[c:])
            _widen_block(value_cache, phys, kvh, keys, fmt, v_tile[c:])
        # All rows x all keys of the step in one sgemm instead of a dot-product
        # loop per (row, key), and P @ V below: with np.exp, 1.9x on a 512-token
        # prefill at head_dim 128 (44 -> 23 ms), a few % on decodes.
        s = s_buf[:rows * n].reshape((rows, n))
        np.dot(q, k_tile[:n].T, s)
        for r in range(rows):
            seen = min(n, context_len + t0 + r // group - start + 1)  # causal: the row sees keys 0..seen-1
            m_new = m[r]
            for j in range(seen):
                m_new = max(m_new, s[r, j])
            a = np.exp(m[r] - m_new)  # rescales what earlier steps summed (0 on the first)
            l_r = l[r] * a
            for j in range(seen):
                p = _exp(s[r, j] - m_new)
                s[r, j] = p
                l_r += p
            for j in range(max(seen, 0), n):
                s[r, j] = 0.0  # the key lies in this row's future
            alpha[r] = a
            m[r] = m_new
            l[r] = l_r
        # P @ V as a second sgemm instead of acc[r] += p * v per (row, key),
        # then the rescale and the sum in one pass over acc. A masked key adds
        # 0 * v: v must be a real key's value, never a NaN slot past seq_len
        # (0 * NaN = NaN), hence n stops at kv_end.
        np.dot(s, v_tile[:n], pv)
        for r in range(rows):
            for d in range(head_dim):
                acc[r, d] = acc[r, d] * alpha[r] + pv[r, d]
    for r in range(rows):
        tok, head = q_start + t0 + r // group, kvh * group + r % group
        inv = np.float32(1.0) / l[r]  # l >= 1: every row saw key 0 and its own max
        for d in range(head_dim):
            out[tok, head, d] = acc[r, d] * inv


def plan_items(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, tile_tokens: int):
    """Work items (sequence, first query token of a tile), longest first: with
    items handed out one at a time, the last to start are the short ones and
    the threads finish together. Plain numpy (tens of microseconds): a
    compiled argsort would add seconds to the first call."""
    q_lens = np.diff(cu_seqlens_q.astype(np.int64))
    tiles = (q_lens + tile_tokens - 1) // tile_tokens
    item_seq = np.repeat(np.arange(len(q_lens)), tiles)
    first_item = np.cumsum(tiles) - tiles
    item_t0 = (np.arange(len(item_seq)) - first_item[item_seq]) * tile_tokens
    t1 = np.minimum(item_t0 + tile_tokens, q_lens[item_seq])
    cost = (t1 - item_t0) * (seq_lens[item_seq] - q_lens[item_seq] + t1)  # rows x keys read
    order = np.argsort(-cost, kind="stable")
    return item_seq[order], item_t0[order]


@njit(cache=True, parallel=True)
def _varlen_kernel(query, key_cache, value_cache, out, block_tables, cu_seqlens_q, seq_lens, item_seq, item_t0,
                   tile_tokens, fmt, scale, step_keys, q_tile, acc, m, l, alpha, s_buf, pv_buf, k_tile, v_tile):
    """Every (item, KV head) pair in one prange; scratch arrays have one slice per thread."""
    num_kv_heads = key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    for w in prange(item_seq.shape[0] * num_kv_heads):
        it, kvh = w // num_kv_heads, w % num_kv_heads
        i, t0 = item_seq[it], item_t0[it]
        q_start = cu_seqlens_q[i]
        q_len = cu_seqlens_q[i + 1] - q_start
        tid = numba.get_thread_id()
        _attend_item(query, key_cache, value_cache, out, block_tables[i], seq_lens[i], q_start, q_len,
                     t0, min(t0 + tile_tokens, q_len), kvh, group, fmt, scale, step_keys, q_tile[tid], acc[tid],
                     m[tid], l[tid], alpha[tid], s_buf[tid], pv_buf[tid], k_tile[tid], v_tile[tid])


_blas_libraries = None  # threadpoolctl's handles on the process's BLAS libraries, found on first use


@contextlib.contextmanager
def _single_threaded_blas():
    """BLAS held to one thread inside the block, then set back. numba's np.dot
    calls scipy's OpenBLAS from inside the prange threads, and OpenBLAS splits
    any product above 64 x 64 x 64 multiply-adds over threads of its own, as
    many as there are cores unless OPENBLAS_NUM_THREADS / OMP_NUM_THREADS say
    otherwise: 2 numba threads x 2 BLAS threads on 2 cores. Measured on one
    core with 2 BLAS threads: a 64 x 64 x 128 product took 15.6 ms instead of
    12.8 us, a 512-token prefill 11.8 s instead of 20 ms (the threads spin,
    waiting for each other). threadpoolctl (installed with scikit-learn, which
    lm-eval needs) finds every loaded BLAS whatever its build; without it BLAS
    is left as configured. Costs 2 us a call (11 us when it has to change and
    restore a thread count), against the call's fixed 50 us."""
    global _blas_libraries
    if _blas_libraries is None:
        try:
            from threadpoolctl import ThreadpoolController
            _blas_libraries = ThreadpoolController().select(user_api="blas").lib_controllers
        except ImportError:
            _blas_libraries = []
    changed = []
    for lib in _blas_libraries:
        threads = lib.get_num_threads()
        if threads is not None and threads > 1:
            lib.set_num_threads(1)
            changed.append((lib, threads))
    try:
        yield
    finally:
        for lib, threads in changed:
            lib.set_num_threads(threads)


def _cache_bits(cache: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of the cache's raw bits (uint32 or uint16)."""
    if cache.dtype == torch.float32:
        return cache.view(torch.int32).numpy().view(np.uint32)
    return cache.view(torch.int16).numpy().view(np.uint16)


def check_cpu_inputs(query, key_cache, value_cache) -> None:
    """The per-call checks, none of which reads tensor data: shapes and dtypes
    (as Chapter 1's checks), CPU tensors, contiguous caches."""
    _, _, num_kv_heads, _ = check_kv_cache(key_cache, value_cache)
    check_query(query, key_cache)
    check_num_heads(query.shape[1], num_kv_heads)
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU for the cpu kernel, got {t.device}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not t.is_contiguous():  # read in place: copying the whole cache per call would defeat the kernel
            raise ValueError(f"{name} must be contiguous for the cpu kernel, got strides {t.stride()}")


def run_varlen(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale) -> torch.Tensor:
    """The kernel without argument checks, for callers that checked once per
    step (the engine's AttentionMetadata.validate). Same result as
    `paged_attention_varlen`."""
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return torch.empty_like(query)
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    tile_tokens = max(1, TILE_ROWS // group)
    step_keys = block_size * max(1, KV_TILE_BYTES // (4 * head_dim) // block_size)
    cu = cu_seqlens_q.contiguous().numpy()
    seq_lens = seq_lens.to(torch.int32).contiguous().numpy()
    item_seq, item_t0 = plan_items(cu, seq_lens, tile_tokens)
    torch_threads = torch.get_num_threads()
    nthreads = max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(nthreads)
    # Per-thread scratch, allocated once per call (not once per item, inside the
    # loop): about 3 us of the call's fixed 50 us, so not cached across calls.
    rows = tile_tokens * group
    f32 = np.float32
    scratch = (np.empty((nthreads, rows, head_dim), f32), np.empty((nthreads, rows, head_dim), f32),  # Q, acc
               np.empty((nthreads, rows), f32), np.empty((nthreads, rows), f32),  # running max, running sum
               np.empty((nthreads, rows), f32),  # alpha, each row's rescale in this step
               np.empty((nthreads, rows * step_keys), f32), np.empty((nthreads, rows * head_dim), f32),  # S/P, P @ V
               np.empty((nthreads, step_keys, head_dim), f32), np.empty((nthreads, step_keys, head_dim), f32))  # K, V
    fp32 = query.dtype == torch.float32
    out = torch.empty_like(query) if fp32 else torch.empty(query.shape, dtype=torch.float32)
    # Items are handed out one at a time, not in equal slices. Set here, not in the
    # kernel: numba cannot cache a function that sets it (a ctypes global).
    previous = numba.set_parallel_chunksize(1)
    try:
        with _single_threaded_blas():
            _varlen_kernel(query.detach().float().contiguous().numpy(), _cache_bits(key_cache),
                           _cache_bits(value_cache), out.numpy(), block_tables.contiguous().numpy(), cu, seq_lens,
                           item_seq, item_t0, tile_tokens, _FORMATS[key_cache.dtype], f32(scale), step_keys, *scratch)
    finally:
        numba.set_parallel_chunksize(previous)
        # numba's OpenMP layer shares libgomp with torch, and starting it sets the
        # process-wide OpenMP thread count to NUMBA_NUM_THREADS (every core): left
        # alone, every later torch op would ignore OMP_NUM_THREADS / set_num_threads.
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
    return out if fp32 else out.to(query.dtype)


def paged_attention_varlen(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale):
    """query [num_tokens, num_heads, head_dim]; sequence i owns rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1], its last q_len_i positions, attended
    causally. Returns [num_tokens, num_heads, head_dim] in query's dtype."""
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs)
    check_cu_seqlens_q(cu_seqlens_q, seq_lens, query.shape[0], key_cache.device)
    check_cpu_inputs(query, key_cache, value_cache)
    return run_varlen(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale)


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """One new token per sequence: query [num_seqs, num_heads, head_dim] is
    position seq_len - 1 and sees all seq_len cached positions."""
    num_seqs = query.shape[0] if isinstance(query, torch.Tensor) and query.dim() == 3 else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs)
    check_cpu_inputs(query, key_cache, value_cache)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)  # a decode is a varlen batch of q_len 1
    return run_varlen(query, key_cache, value_cache, block_tables, cu, seq_lens, scale)
