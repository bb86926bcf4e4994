"""Chapter 2 benchmark: are block-pool operations O(1), and what does a prefix lookup cost?

1. Per-operation cost of allocate (`get_new_blocks(1)`, evicting a cached
   hash), free (`free_blocks([b])`) and touch (a hit on a free block: lazy
   removal from the middle of the queue) at 1k, 100k and 1M blocks.
   Goal: flat, 1M within 1.5x of 1k. Two free-queue orders are measured:
   "sequential" (queue order = memory order, as right after start-up) and
   "shuffled" (a long-running server: blocks come back in arbitrary order, so
   every operation touches cold memory at 1M blocks).
2. Prefix lookup per block at a 0% hit rate, hashing included (fresh requests,
   so no hash is reused between measured calls). Goal: <= 2 us per block.
   Shown next to a naive pickle encoding to show what the struct encoding buys.

The machine is shared, so every figure is the minimum over many short trials
(the least-disturbed run), measured side by side in one process.
Run: .venv/bin/python benchmarks/bench_ch2_block_pool.py
"""
from __future__ import annotations

import gc
import hashlib
import pickle
import random
import time

from mini_vllm.kvcache import BlockPool, KVCacheManager, SimpleRequest, hash_block_tokens

OPS = 200       # operations per trial
TRIALS = 80     # trials per figure; the minimum is reported
SIZES = (1_000, 100_000, 1_000_000)


def _ns_per_op(fn, n_ops: int) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / n_ops


def make_pool(num_blocks: int, shuffled: bool, rng: random.Random) -> BlockPool:
    pool = BlockPool(num_blocks)
    blocks = pool.get_new_blocks(num_blocks)
    # Every block cached, so allocation also pays for an eviction, as in a warm cache.
    pool.cache_full_blocks(blocks, [i.to_bytes(32, "little") for i in range(num_blocks)], 0, num_blocks)
    if shuffled:
        rng.shuffle(blocks)
    pool.free_blocks(blocks)
    return pool


def bench_pool(pool: BlockPool, rng: random.Random) -> dict[str, float]:
    best = {"allocate": float("inf"), "free": float("inf"), "touch": float("inf")}
    gc.disable()
    try:
        for _ in range(TRIALS):
            got = []
            a = _ns_per_op(lambda: [got.append(pool.get_new_blocks(1)[0]) for _ in range(OPS)], OPS)
            f = _ns_per_op(lambda: [pool.free_blocks((b,)) for b in got], OPS)
            # Hits on free blocks scattered through the queue (lazy removal from the middle).
            hits = [b for b in rng.sample(pool.blocks, 4 * OPS) if b.ref_cnt == 0][:OPS]
            t = _ns_per_op(lambda: [pool.touch((b,)) for b in hits], len(hits))
            pool.free_blocks(hits)
            for k, v in (("allocate", a), ("free", f), ("touch", t)):
                best[k] = min(best[k], v)
    finally:
        gc.enable()
    return best


def bench_lookup(block_size: int = 16, blocks_per_prompt: int = 32, trials: int = 200):
    """Minimum over `trials` fresh random prompts of get_computed_blocks time per block."""
    m = KVCacheManager(4096, block_size)
    rng = random.Random(1)
    best = float("inf")
    for i in range(trials):
        r = SimpleRequest(f"q{i}", [rng.randrange(32000) for _ in range(block_size * blocks_per_prompt + 1)])
        t0 = time.perf_counter_ns()
        _, n = m.get_computed_blocks(r)
        best = min(best, (time.perf_counter_ns() - t0) / blocks_per_prompt)
        assert n == 0, "random prompts must miss"
        m.free(r)
    toks = [r.all_token_ids[i * block_size:(i + 1) * block_size] for i in range(blocks_per_prompt)]
    best_struct = best_pickle = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter_ns()
        h = None
        for t in toks:
            h = hash_block_tokens(h, t)
        best_struct = min(best_struct, (time.perf_counter_ns() - t0) / len(toks))
        t0 = time.perf_counter_ns()
        h = b""
        for t in toks:
            h = hashlib.sha256(pickle.dumps((h, tuple(t), None), protocol=5)).digest()
        best_pickle = min(best_pickle, (time.perf_counter_ns() - t0) / len(toks))
    return best, best_struct, best_pickle


def main():
    rng = random.Random(0)
    print(f"Chapter 2 block pool: ns per operation (min of {TRIALS} trials x {OPS} ops)")
    for shuffled in (False, True):
        order = "shuffled" if shuffled else "sequential"
        print(f"\nfree-queue order: {order}")
        print(f"{'blocks':>10} {'allocate':>10} {'free':>10} {'touch':>10}")
        rows = {}
        for n in SIZES:
            pool = make_pool(n, shuffled, rng)
            rows[n] = bench_pool(pool, rng)
            del pool
            r = rows[n]
            print(f"{n:>10,} {r['allocate']:>10.0f} {r['free']:>10.0f} {r['touch']:>10.0f}")
        base = rows[SIZES[0]]
        for n in SIZES[1:]:
            ratios = "  ".join(f"{k} {rows[n][k] / base[k]:.2f}x" for k in base)
            print(f"ratio {n:>9,} / {SIZES[0]:,}: {ratios}   (goal: 1M <= 1.5x)")
    lookup, struct_ns, pickle_ns = bench_lookup()
    print(f"\nprefix lookup at 0% hit rate, block_size 16, hashing included: {lookup / 1000:.2f} us/block "
          "(goal: <= 2 us)")
    print(f"hash only: struct encoding {struct_ns / 1000:.2f} us/block, pickle encoding "
          f"{pickle_ns / 1000:.2f} us/block (pickle / struct = {pickle_ns / struct_ns:.2f}x)")


if __name__ == "__main__":
    main()
