"""The engine's CPU attention: the compiled "cpu" kernel vs `torch_attention.attend`,
and both against the memory-traffic floor.

vLLM counterpart: the CPU attention backend (`vllm/v1/attention/backends/cpu_attn.py`,
`csrc/cpu/cpu_attn.cpp`); `benchmarks/kernels/benchmark_paged_attention.py` times
vLLM's kernels the same way, on synthetic paged caches.

  cpu     `mini_vllm.kernels.cpu_paged_attention.run_varlen`, what the "cpu"
          backend calls per layer: one launch that reads each K/V block in
          place, once; on a CPU with AVX512_BF16 or AVX2 + FMA the C++ kernel
          (`kernels/cpu_native.py`, that build) for fp32 and bf16 caches, else numba's
  numba   the same call with the C++ kernel switched off: the numba kernel,
          which every other CPU runs (printed where the C++ kernel ran)
  torch   `mini_vllm.attention.torch_attn.attend`, the "torch" backend: a gather of
          every block into a padded tensor, then masked SDPA per group (its
          per-step plan is cached on the metadata, as in the engine)

The floor: a kernel must read every K/V row of the batch at least once, so it
cannot beat bytes(K/V) / bandwidth, with the bandwidth measured here as a
256 MiB `dst.copy_(src)` (bytes copied per second) with the same thread count.
"x floor" is a kernel's time over that floor (1.0 = memory-bound optimum).
"% read bw" is the kernel's K/V bytes per second as a share of the machine's
read bandwidth (`machine.read_bandwidth`, same thread count: one sequential
stream on 2 MiB pages): reading alone is faster than a copy, so this is the
stricter measure for decodes. Neither is what a decode can reach: its blocks lie
wherever the block pool put them, and each jump from one block to the next
starts a new stream for the prefetchers. "blocks ms" is that ceiling, measured:
`csrc/block_read.cpp` reads the same blocks in the kernel's order, with the
kernel's prefetches, and does nothing else; "% blocks" is its time as a share
of the kernel's (100% = the kernel is as fast as reading; 1 thread, all-decode
batches only). The caches sit on 2 MiB pages, as the engine's do.
That holds for decodes; a prefill reuses each K/V row for many queries and is
bound by arithmetic instead (4 x head_dim flops per query head and visible
key: the scores and P @ V), so the cpu kernel's GFLOP/s is printed too.
Only attention is timed: both backends write the cache with the same
`reshape_and_cache` first. Outputs are checked against Chapter 1's reference
before timing; times are the best of REPEATS calls, the two kernels called
alternately so background load hits both alike. By default the batch's K/V
may still sit in the L3 cache from the previous call (29 MB for the first
batch, 32 MB of L3 on the 2-core machine); `--cold` evicts it before every
timed call, as in the engine, where one layer's K/V (128 sequences of 400
tokens: 52 MB) and the other layers' pass through the cache between two
visits. Decodes are memory-bound, so they read closer to the engine cold.

The fixed cost of a call (planning, numba's argument unboxing, scratch) is
paid per layer and step; it is printed as the time of a 1-token decode.

Compile time: the kernel's first call in a fresh process with an empty numba
cache (the compile a learner waits for once), and with the on-disk cache.

`--isa avx2` reruns the whole script as on a CPU without AVX-512
(`cpu_runtime.AVX2_ONLY_ENV`: numba compiles for Haswell, torch, oneDNN, MKL and
OpenBLAS are held to AVX2), compile times included.

Run: .venv/bin/python benchmarks/bench_engine_attention.py [--threads 1,2] [--cold] [--isa native|avx2]
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from machine import machine_line, read_bandwidth
from mini_vllm.kernels import cpu_native
from mini_vllm.kernels.cpu_runtime import AVX2_ONLY_ENV
from mini_vllm.attention import torch_attn as torch_attention
from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.kernels.cpu_paged_attention import plan_items, run_varlen
from mini_vllm.worker.host_memory import hugepage_zeros
from mini_vllm.paged_attention import paged_attention_varlen

REPEATS = 20
BS = 16
QWEN3 = (16, 8, 128)  # Qwen3-0.6B attention: query heads, KV heads, head_dim
ISSUE = (4, 2, 64)    # the decode batch of the issue that proposed this kernel; tiny-py-target's attention


def _lens(n, lo, hi, seed):
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


# name -> (heads, seq_lens, q_lens, dtype[, block size: BS if not given])
BATCHES = {
    "decode x64, 200-700, heads 4/2 d64": (ISSUE, _lens(64, 200, 700, 1), [1] * 64, torch.float32),
    # the throughput benchmark's decode steps: up to 128 sequences of 16-768 tokens, block 32
    "decode x128, 16-768, 4/2 d64, block 32": (ISSUE, _lens(128, 16, 768, 7), [1] * 128, torch.float32, 32),
    # the same decodes with blocks of 128 (vLLM's CPU default): runs of 64 KiB between jumps, not
    # 16 KiB; on the Zen 4 test machine neither the kernel nor the plain read of the blocks
    # was faster for it
    "decode x128, 16-768, 4/2 d64, block 128": (ISSUE, _lens(128, 16, 768, 7), [1] * 128, torch.float32, 128),
    "decode x16, 256-1024, Qwen3 heads": (QWEN3, _lens(16, 256, 1024, 2), [1] * 16, torch.float32),
    "decode x16, 256-1024, Qwen3, bf16": (QWEN3, _lens(16, 256, 1024, 2), [1] * 16, torch.bfloat16),
    "prefill 256, heads 4/2 d64": (ISSUE, [256], [256], torch.float32),
    "prefill x2, 512, heads 4/2 d64, bf16": (ISSUE, [512, 512], [512, 512], torch.bfloat16),
    "mixed: 2 chunks of 256 + 14 decodes, d64": (ISSUE, [768, 512] + _lens(14, 256, 1024, 3), [256, 256] + [1] * 14,
                                                 torch.float32),
    # the qwen3-0.6b throughput workload's steps: 16 requests of 16-128 prompt tokens, block 32
    "decode x16, 80-190, Qwen3, bf16, block 32": (QWEN3, _lens(16, 80, 190, 5), [1] * 16, torch.bfloat16, 32),
    "prefill x16, 16-128, Qwen3, bf16, block 32": (QWEN3, _lens(16, 16, 128, 5), _lens(16, 16, 128, 5),
                                                   torch.bfloat16, 32),
    "prefill 256, Qwen3 heads": (QWEN3, [256], [256], torch.float32),
    "prefill x2, 512 tokens": (QWEN3, [512, 512], [512, 512], torch.float32),
    "mixed: 2 chunks of 256 + 14 decodes": (QWEN3, [768, 512] + _lens(14, 256, 1024, 3), [256, 256] + [1] * 14,
                                            torch.float32),
}


def make(heads, seq_lens, q_lens, dtype, block_size=BS, seed=0):
    """Random caches, shuffled block tables, this step's queries and the metadata."""
    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    ids = list(range(sum(needed) + 8))
    random.Random(seed).shuffle(ids)
    tables, pos = [], 0
    for n in needed:
        tables.append(ids[pos:pos + n] + [-1] * (max(needed) - n))
        pos += n
    shape = (len(ids), block_size, num_kv_heads, head_dim)
    # On 2 MiB pages where the OS allows, as the engine allocates its cache (cache_engine.py).
    kc, vc = (hugepage_zeros(shape, dtype).copy_(torch.randn(shape, generator=g)) for _ in range(2))
    slots = [t[p // block_size] * block_size + p % block_size
             for t, s, q in zip(tables, seq_lens, q_lens) for p in range(s - q, s)]
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    md = AttentionMetadata(torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                           torch.tensor(cu, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                           max(q_lens), max(seq_lens), list(q_lens), list(seq_lens))
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    kv_bytes = 2 * sum(seq_lens) * num_kv_heads * head_dim * kc.element_size()
    visible = sum(s - q + t + 1 for s, q in zip(seq_lens, q_lens) for t in range(q))  # (query, key) pairs, causal
    return q, kc, vc, md, kv_bytes, 4 * num_heads * head_dim * visible


def block_read_library():
    """benchmarks/csrc/block_read.cpp, built as the kernel is (cpu_native._build); None
    where no compiler builds it."""
    import ctypes
    from pathlib import Path
    try:
        path = cpu_native._build(Path(__file__).parent / "csrc" / "block_read.cpp",
                                 ("-O3", "-std=c++17", "-shared", "-fPIC", "-march=native"))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        print(f"no block-read probe: {e}")
        return None
    lib = ctypes.CDLL(str(path))
    lib.mini_vllm_block_read.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    lib.mini_vllm_block_read.restype = ctypes.c_uint64
    return lib


def block_spans(q, kc, md, threads: int) -> np.ndarray | None:
    """(byte offset, bytes) of every block a decode batch reads, in the kernel's order (its
    plan's items, each sequence's blocks in turn); None unless every sequence is a decode
    whose item covers all KV heads (then each block's readable slots are one run)."""
    _, block_size, num_kv_heads, head_dim = kc.shape
    cu, seq_lens = md.cu_seqlens_q.numpy(), md.seq_lens.numpy()
    if (np.diff(cu) != 1).any():
        return None
    item_seq, _, _, decode_heads = plan_items(cu, seq_lens, 16, num_kv_heads, q.shape[1] // num_kv_heads, threads)
    if decode_heads != num_kv_heads:
        return None
    slot_bytes = num_kv_heads * head_dim * kc.element_size()
    tables, spans = md.block_tables.numpy(), []
    for i in item_seq:
        for b in range(-(-int(seq_lens[i]) // block_size)):
            n = min(block_size, int(seq_lens[i]) - b * block_size)
            spans.append((int(tables[i, b]) * block_size * slot_bytes, n * slot_bytes))
    return np.array(spans, np.int64)


def copy_bandwidth(repeats: int = 10) -> float:
    """Bytes per second of a 256 MiB tensor copy (each byte read once, written once)."""
    src = torch.ones(64 << 20)  # 256 MiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() * src.element_size() / best


_EVICT = None  # a buffer twice the size of the L3 cache, written to evict it (--cold)


def evict_caches():
    global _EVICT
    if _EVICT is None:
        _EVICT = torch.zeros(64 << 20, dtype=torch.uint8)
    _EVICT.add_(1)


def best_interleaved(fns, cold=False) -> list[float]:
    times = [[] for _ in fns]
    for _ in range(REPEATS):
        for fn, ts in zip(fns, times):
            if cold:
                evict_caches()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [min(ts) for ts in times]


def numba_only(fn):
    """fn with the C++ kernel switched off for the call (the numba kernel runs)."""
    def call():
        with cpu_native.numba_only():
            return fn()
    return call


def fixed_cost_us(repeats: int = 200) -> float:
    """Best time of the cpu kernel on a 1-token decode: what every call pays."""
    kc = torch.randn(2, BS, 2, 64)
    args = (torch.randn(1, 4, 64), kc, kc.clone(), torch.tensor([[0]], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 0.125)
    run_varlen(*args)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_varlen(*args)
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e6


_FIRST_CALL = """
import sys, time, torch
from mini_vllm.kernels.cpu_paged_attention import paged_attention_varlen
kc = torch.randn(4, 16, 2, 64); q = torch.randn(3, 4, 64)
args = (torch.tensor([[0, 1], [2, -1]], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32),
        torch.tensor([20, 2], dtype=torch.int32), 0.125)
for dtype in (torch.float32, torch.bfloat16):
    t0 = time.perf_counter()
    paged_attention_varlen(q.to(dtype), kc.to(dtype), kc.to(dtype), *args)
    sys.stdout.write(f"{time.perf_counter() - t0:.2f} ")
"""


def first_call_seconds(cache_dir: str) -> list[float]:
    """First call per dtype (fp32, bf16) in a fresh process using `cache_dir` as numba's cache."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True, check=True)
    return [float(x) for x in out.stdout.split()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="2", help="comma-separated thread counts, e.g. 1,2")
    parser.add_argument("--cold", action="store_true", help="evict the L3 cache before every timed call")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="avx2: rerun this script as on a CPU without AVX-512 (cpu_runtime.AVX2_ONLY_ENV)")
    args = parser.parse_args()
    if args.isa == "avx2" and os.environ.get("NUMBA_CPU_NAME") != AVX2_ONLY_ENV["NUMBA_CPU_NAME"]:
        # The libraries read their ISA settings once, at load: a fresh interpreter with them set.
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, **AVX2_ONLY_ENV))
    if args.isa == "avx2":
        print("ISA held to AVX2 + FMA (numba targets haswell; torch, oneDNN, MKL and OpenBLAS limited to AVX2)")
    with tempfile.TemporaryDirectory() as cache_dir:
        cold = first_call_seconds(cache_dir)
        warm = first_call_seconds(cache_dir)
    print(f"cpu kernel first call, fresh process: {cold[0]:.1f} s fp32 + {cold[1]:.1f} s bf16 with an empty "
          f"numba cache (compile); {warm[0]:.2f} s + {warm[1]:.2f} s from the disk cache")
    cases = {name: make(*spec) for name, spec in BATCHES.items()}
    for name, (q, kc, vc, md, _, _) in cases.items():
        scale = q.shape[-1] ** -0.5
        want = paged_attention_varlen(q, kc, vc, md.block_tables, md.cu_seqlens_q, md.seq_lens, scale).float()
        tol = 1e-4 if q.dtype == torch.float32 else 2e-2
        cpu = lambda: run_varlen(q, kc, vc, md.block_tables, md.cu_seqlens_q, md.seq_lens, scale)  # noqa: E731
        for impl, got in (("cpu", cpu()), ("numba", numba_only(cpu)()),
                          ("torch", torch_attention.attend(q, kc, vc, md, scale))):
            err = (got.float() - want).abs().max().item()
            assert err < tol, f"{name}: {impl} differs from Chapter 1's reference by {err:.2e}"
    print(machine_line([int(t) for t in args.threads.split(",")]))
    reason = cpu_native.unavailable_reason()
    print(f"cpu = the C++ kernel ({cpu_native.isa()} build) for fp32 / bf16 caches, numba for fp16" if reason is None else
          f"cpu = the numba kernel (the C++ kernel cannot run here: {reason})")
    probe = block_read_library()
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)  # the kernel follows torch's thread count
        bw = copy_bandwidth()
        read_bw = read_bandwidth(threads) * 1e9  # bytes per second
        print(f"\n{threads} thread(s): copy bandwidth {bw / 1e9:.1f} GB/s, read bandwidth {read_bw / 1e9:.1f} GB/s; "
              f"block {BS} unless named, best of "
              f"{REPEATS}, {'L3 evicted before each call' if args.cold else 'L3 as the last call left it'}; "
              f"cpu kernel fixed cost {fixed_cost_us():.0f} us a call")
        print(f"{'batch':42s} {'K/V MB':>7s} {'floor ms':>9s} {'cpu ms':>8s} {'x floor':>8s} "
              f"{'cpu GFLOP/s':>12s} {'% read bw':>10s} {'blocks ms':>10s} {'% blocks':>9s} {'numba ms':>9s} "
              f"{'numba/cpu':>10s} {'torch ms':>9s} {'x floor':>8s} {'torch/cpu':>10s}")
        for name, (q, kc, vc, md, kv_bytes, flops) in cases.items():
            scale = q.shape[-1] ** -0.5
            cpu = lambda: run_varlen(q, kc, vc, md.block_tables, md.cu_seqlens_q, md.seq_lens, scale)  # noqa: E731
            fns = [cpu, numba_only(cpu), lambda: torch_attention.attend(q, kc, vc, md, scale)]
            spans = block_spans(q, kc, md, threads) if probe is not None and threads == 1 else None
            if spans is not None:
                fns.append(lambda: probe.mini_vllm_block_read(kc.data_ptr(), vc.data_ptr(), spans.ctypes.data,
                                                              len(spans)))
            with torch.no_grad():
                t_cpu, t_numba, t_torch, *t_blocks = best_interleaved(fns, cold=args.cold)
            floor = kv_bytes / bw
            blocks = f"{t_blocks[0] * 1e3:10.2f} {100 * t_blocks[0] / t_cpu:8.0f}%" if t_blocks else f"{'-':>10s} {'-':>9s}"
            print(f"{name:42s} {kv_bytes / 1e6:7.1f} {floor * 1e3:9.2f} {t_cpu * 1e3:8.2f} {t_cpu / floor:8.2f} "
                  f"{flops / t_cpu / 1e9:12.1f} {100 * kv_bytes / t_cpu / read_bw:9.0f}% {blocks} {t_numba * 1e3:9.2f} "
                  f"{t_numba / t_cpu:9.2f}x {t_torch * 1e3:9.2f} {t_torch / floor:8.2f} {t_torch / t_cpu:9.2f}x")


if __name__ == "__main__":
    main()
