"""Triton paged attention vs the PyTorch reference vs contiguous SDPA, side by side.

Three implementations of one decode batch and one mixed (varlen) batch:

  triton      `mini_vllm.kernels.paged_attention`: one fused kernel that reads
              K/V blocks in place through the block table
  reference   `mini_vllm.paged_attention`: the chapter's readable PyTorch loop
  contiguous  `torch.nn.functional.scaled_dot_product_attention` on K/V laid out
              contiguously per sequence (no block table): the baseline the
              thesis compares PagedAttention against (seed 001 §3.7.1 reports
              20-26% kernel overhead for paging on GPU)

Every output is checked against the contiguous result before timing. On a GPU
the shapes are realistic (Qwen3-0.6B heads, fp16, 2048-token contexts) and
times come from CUDA events. Without CUDA the kernel runs in Triton's
interpreter, which is orders of magnitude slower than a GPU; the script then
uses tiny shapes and its ratios only show that the pieces run, not how fast
the kernel is.

Run: .venv/bin/python benchmarks/bench_kernels_paged_attention.py
"""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

from mini_vllm import paged_attention as ref_pa
from mini_vllm.kernels import prepare_triton

prepare_triton()  # without CUDA: Triton's interpreter, selected before triton is imported
from mini_vllm.kernels import paged_attention as triton_pa  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.float16 if CUDA else torch.float32
H, KVH, D, BS = 16, 8, 128, 16                     # Qwen3-0.6B attention heads
DECODE = (64, 2048) if CUDA else (2, 48)           # (num_seqs, seq_len)
VARLEN = ([2048] * 4 + [1024] * 4, [512] * 4 + [1] * 4) if CUDA else ([40, 24], [8, 1])
REPEATS = 20 if CUDA else 3


def _time(fn) -> float:
    """Median seconds per call."""
    fn()
    times = []
    for _ in range(REPEATS):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_batch(seq_lens: list[int], q_lens: list[int], gen: torch.Generator):
    """A paged cache filled through a shuffled block table, plus the same K/V contiguous."""
    blocks_per_seq = [math.ceil(s / BS) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    perm = torch.randperm(num_blocks, generator=gen)  # non-contiguous physical blocks
    table = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    key_cache = torch.randn(num_blocks, BS, KVH, D, generator=gen).to(DTYPE)
    value_cache = torch.randn(num_blocks, BS, KVH, D, generator=gen).to(DTYPE)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    ks, vs = [], []
    for i, s in enumerate(seq_lens):
        k, v = ref_pa.gather_kv(key_cache, value_cache, table[i], s)
        ks.append(k)
        vs.append(v)
    query = torch.randn(sum(q_lens), H, D, generator=gen).to(DTYPE)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    to = dict(device=DEV)
    return (query.to(**to), key_cache.to(**to), value_cache.to(**to), table.to(**to), cu.to(**to),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
            [k.to(**to) for k in ks], [v.to(**to) for v in vs])


def contiguous_attention(query, cu, seq_lens, ks, vs, scale):
    """SDPA per sequence on contiguous K/V; queries are the last q_len positions."""
    out = torch.empty_like(query)
    for i, (k, v) in enumerate(zip(ks, vs)):
        a, b = int(cu[i]), int(cu[i + 1])
        s, q_len = k.shape[0], b - a
        allowed = (torch.arange(s, device=DEV)[None, :]
                   <= torch.arange(s - q_len, s, device=DEV)[:, None])  # causal with offset
        o = F.scaled_dot_product_attention(
            query[a:b].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=allowed, scale=scale, enable_gqa=True)
        out[a:b] = o.transpose(0, 1)
    return out


def run(name: str, seq_lens: list[int], q_lens: list[int], gen: torch.Generator) -> None:
    query, kc, vc, table, cu, sl, ks, vs = make_batch(seq_lens, q_lens, gen)
    scale = 1 / math.sqrt(D)
    impls = {
        "triton": lambda: triton_pa.paged_attention_varlen(query, kc, vc, table, cu, sl, scale),
        "reference": lambda: ref_pa.paged_attention_varlen(query, kc, vc, table, cu, sl, scale),
        "contiguous": lambda: contiguous_attention(query, cu, sl, ks, vs, scale),
    }
    want = impls["contiguous"]().float()
    tol = 2e-2 if DTYPE != torch.float32 else 1e-4
    for k, fn in impls.items():
        err = (fn().float() - want).abs().max().item()
        assert err <= tol, f"{k} disagrees with contiguous SDPA by {err:.2e} (> {tol}): wrong attention"
    times = {k: _time(fn) for k, fn in impls.items()}
    print(f"\n{name}: {len(seq_lens)} seqs, seq_lens {sorted(set(seq_lens))}, q_lens {sorted(set(q_lens))}, "
          f"{str(DTYPE).replace('torch.', '')} on {DEV}")
    for k, t in times.items():
        print(f"  {k:10s} {t * 1e3:10.3f} ms")
    print(f"  triton / contiguous = {times['triton'] / times['contiguous']:.3g}x   "
          f"reference / triton = {times['reference'] / times['triton']:.3g}x")


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    mode = "GPU" if CUDA else "Triton interpreter on CPU (tiny shapes; ratios are not kernel speed)"
    print(f"Paged attention kernels, {mode}; median of {REPEATS}")
    n, s = DECODE
    run("decode", [s] * n, [1] * n, gen)
    run("varlen (prefill chunks + decodes)", *VARLEN, gen)


if __name__ == "__main__":
    main()
