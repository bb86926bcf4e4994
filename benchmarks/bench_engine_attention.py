"""The engine's "torch" attention backend vs Chapter 1's reference, side by side.

Both do the same work per call: write this step's K/V into the paged cache
(`reshape_and_cache`), then paged attention over the whole batch.

  backend     `mini_vllm.attention_backends` "torch": one gather through the
              block tables into a padded batch, one masked SDPA call
  reference   `mini_vllm.paged_attention.paged_attention_varlen`: a readable
              Python loop, one einsum attention per sequence

Two batches with Qwen3-0.6B attention heads (16 query, 8 KV, head_dim 128),
block size 16, float32 on the CPU: a batch-16 decode and a mixed batch
(prefill chunks beside decodes). Outputs are checked against each other
before timing; times are the best of N runs with 2 threads, the two
implementations called alternately so background load hits both alike.

Run: .venv/bin/python benchmarks/bench_engine_attention.py
"""
from __future__ import annotations

import random
import time

import torch

from mini_vllm.attention_backends import get_attn_backend
from mini_vllm.forward_context import AttentionMetadata
from mini_vllm.paged_attention import paged_attention_varlen, reshape_and_cache

H, KVH, D, BS = 16, 8, 128, 16
REPEATS = 20
BATCHES = {
    "decode x16, seq_len 256-1024": ([random.Random(i).randint(256, 1024) for i in range(16)], [1] * 16),
    "mixed: 2 chunks of 256 + 14 decodes": ([768, 512] + [random.Random(i).randint(256, 1024) for i in range(14)],
                                            [256, 256] + [1] * 14),
}


def make(seq_lens, q_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    needed = [-(-s // BS) for s in seq_lens]
    ids = list(range(sum(needed) + 8))
    random.Random(seed).shuffle(ids)
    tables, pos = [], 0
    for n in needed:
        tables.append(ids[pos:pos + n] + [-1] * (max(needed) - n))
        pos += n
    shape = (len(ids), BS, KVH, D)
    kc, vc = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    slots = [t[p // BS] * BS + p % BS for t, s, q in zip(tables, seq_lens, q_lens) for p in range(s - q, s)]
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    md = AttentionMetadata(torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                           torch.tensor(cu, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                           max(q_lens), max(seq_lens), list(q_lens), list(seq_lens))
    n = sum(q_lens)
    return (torch.randn(n, H, D, generator=g), torch.randn(n, KVH, D, generator=g),
            torch.randn(n, KVH, D, generator=g), kc, vc, md)


def best_interleaved(fns) -> list[float]:
    """Best time of each fn; calls alternate so a noisy neighbour slows both alike."""
    times = [[] for _ in fns]
    for _ in range(REPEATS):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [min(ts) for ts in times]


def main():
    torch.set_num_threads(2)
    backend = get_attn_backend("torch")
    scale = D ** -0.5
    print(f"heads {H}/{KVH}, head_dim {D}, block {BS}, float32, CPU, 2 threads, best of {REPEATS}")
    print(f"{'batch':40s} {'reference ms':>13s} {'torch ms':>9s} {'speed-up':>9s}")
    for name, (seq_lens, q_lens) in BATCHES.items():
        q, k, v, kc, vc, md = make(seq_lens, q_lens)

        def reference():
            reshape_and_cache(k, v, kc, vc, md.slot_mapping)
            return paged_attention_varlen(q, kc, vc, md.block_tables, md.cu_seqlens_q, md.seq_lens, scale)

        def torch_backend():
            return backend.forward(q, k, v, kc, vc, md, scale)

        err = (reference() - torch_backend()).abs().max().item()
        assert err < 1e-4, f"{name}: backends disagree by {err}"
        with torch.no_grad():
            t_ref, t_torch = best_interleaved([reference, torch_backend])
        print(f"{name:40s} {t_ref * 1e3:13.2f} {t_torch * 1e3:9.2f} {t_ref / t_torch:8.2f}x")


if __name__ == "__main__":
    main()
