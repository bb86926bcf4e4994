"""Chapter 2 benchmark: are block-pool operations O(1), and what does a prefix lookup cost?

1. Per-operation cost of allocate (`get_new_blocks(1)`, evicting a cached
   hash), free (`free_blocks([b])`) and touch (a hit on a free block: lazy
   removal from the middle of the queue) at 1k, 100k and 1M blocks.
   Goal: flat, 1M within 1.5x of 1k. Two free-queue orders are measured:
   "sequential" (queue order = memory order, as right after start-up) and
   "shuffled" (a long-running server: blocks come back in arbitrary order, so
   every operation touches cold memory at 1M blocks).
   Allocation is measured twice: "alloc+evict" pops a block that still carries
   a cached hash (the warm-cache case: one delete in a dict of N hashes) and
   "alloc" pops an uncached block. A control times a bare Python
   `dict.pop` over N 32-byte keys in the same order: when allocation grows
   with N exactly as the control does, the growth is the memory hierarchy
   (cache and TLB misses in a large hash table), not the algorithm.
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


def make_pool(num_blocks: int, shuffled: bool, rng: random.Random, cached: bool = True) -> BlockPool:
    pool = BlockPool(num_blocks)
    blocks = pool.get_new_blocks(num_blocks)
    if cached:  # every block cached: allocation also pays for an eviction, as in a warm cache
        pool.cache_full_blocks(blocks, [i.to_bytes(32, "little") for i in range(num_blocks)],
                               0, num_blocks)
    if shuffled:
        rng.shuffle(blocks)
    pool.free_blocks(blocks)
    return pool


def bench_pool(pool: BlockPool, rng: random.Random, recache: bool = True) -> dict[str, float]:
    best = {"allocate": float("inf"), "free": float("inf"), "touch": float("inf")}
    gc.disable()
    try:
        next_hash = pool.num_blocks
        for _ in range(TRIALS):
            got = []
            a = _ns_per_op(lambda: [got.append(pool.get_new_blocks(1)[0]) for _ in range(OPS)], OPS)
            if recache:
                # Cache them again (untimed) so that every later allocation also evicts;
                # otherwise a small pool runs out of cached blocks after a few trials.
                pool.cache_full_blocks(got, [(next_hash + i).to_bytes(32, "little") for i in range(OPS)],
                                       0, OPS)
                next_hash += OPS
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


def bench_dict_control(num_keys: int, shuffled: bool, rng: random.Random) -> float:
    """ns per `dict.pop` in a dict of `num_keys` 32-byte keys, popped in
    insertion order (sequential) or at random (shuffled), like the evictions."""
    keys = [i.to_bytes(32, "little") for i in range(num_keys)]
    d = dict.fromkeys(keys)
    order = keys[:]
    if shuffled:
        rng.shuffle(order)
    best, pos = float("inf"), 0
    gc.disable()
    try:
        for _ in range(TRIALS):
            batch = order[pos:pos + OPS]
            if len(batch) < OPS:
                pos, batch = 0, order[:OPS]
            pos += OPS
            best = min(best, _ns_per_op(lambda: [d.pop(k) for k in batch], OPS))
            d.update(dict.fromkeys(batch))
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
        cols = ("alloc+evict", "alloc", "free", "touch", "dict.pop")
        print(f"{'blocks':>10}" + "".join(f"{c:>12}" for c in cols))
        rows = {}
        for n in SIZES:
            pool = make_pool(n, shuffled, rng)
            r = bench_pool(pool, rng)
            del pool
            uncached = bench_pool(make_pool(n, shuffled, rng, cached=False), rng, recache=False)
            rows[n] = {"alloc+evict": r["allocate"], "alloc": uncached["allocate"],
                       "free": r["free"], "touch": r["touch"],
                       "dict.pop": bench_dict_control(n, shuffled, rng)}
            print(f"{n:>10,}" + "".join(f"{rows[n][c]:>12.0f}" for c in cols))
        base = rows[SIZES[0]]
        for n in SIZES[1:]:
            ratios = "  ".join(f"{k} {rows[n][k] / base[k]:.2f}x" for k in cols)
            print(f"ratio {n:>9,} / {SIZES[0]:,}: {ratios}")
        print("goal: 1M within 1.5x of 1k; dict.pop is the control (Python's own hash table)")
    lookup, struct_ns, pickle_ns = bench_lookup()
    print(f"\nprefix lookup at 0% hit rate, block_size 16, hashing included: {lookup / 1000:.2f} us/block "
          "(goal: <= 2 us)")
    print(f"hash only: struct encoding {struct_ns / 1000:.2f} us/block, pickle encoding "
          f"{pickle_ns / 1000:.2f} us/block (pickle / struct = {pickle_ns / struct_ns:.2f}x)")


if __name__ == "__main__":
    main()
