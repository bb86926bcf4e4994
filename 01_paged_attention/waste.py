"""How much of the allocated KV memory holds real token states?

Reproduces the idea of seed 001 §3.3 / Fig. 3.2 ("only 20.4% - 38.2% of the KV
cache memory is used to store the actual token states in the existing
systems") with a synthetic trace. Run it:

    python -m mini_vllm.paged_attention.waste

vLLM counterpart of the paged scheme: `KVCacheManager.allocate_slots`
(`vllm/v1/core/kv_cache_manager.py`), which takes a new block only when the
last one is full.

The measure. A request with prompt length P and output length O lives for O
iterations. In iteration t = 1..O the cache holds used(t) = P + t - 1 token
states (the prompt, then one more per generated token; the last sampled token
is never written back). A scheme allocates alloc(t) >= used(t) slots for it:

    Orca (Max)      2048 slots for the whole lifetime (the model's max length)
    Orca (Pow2)     min(P + next_power_of_two(O), 2048)  (outputs over-reserved <= 2x)
    Orca (Oracle)   P + O                      (knows O exactly)
    Paged (B)       ceil(used(t) / B) * B       (one block at a time)

Effective memory = sum over requests and iterations of used(t) divided by the
same sum of alloc(t): the fraction of slot-iterations holding real states,
i.e. the time average of used/allocated slots while the requests run. Waste
splits into *reserved* (slots that a later token of the same request will fill)
and *internal fragmentation* (slots never filled). External fragmentation of
a buddy allocator is not modelled, so the Orca numbers here are an upper bound
on what those systems achieve.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_LEN = 2048
PAGED_BLOCK_SIZES = (8, 16, 32, 128)

# Trace shapes. The thesis (seed 001 §3.6, Fig. 3.11) says ShareGPT prompts are
# 8.4x longer and outputs 5.8x longer than Alpaca's on average, with more
# variance. We pick ShareGPT-like means of 161 prompt / 338 output tokens (the
# order of magnitude of public ShareGPT traces; an assumption, the thesis gives
# only the ratios) and divide by 8.4 and 5.8 for Alpaca. Lengths are
# log-normal (long right tail, as chat lengths are), with a wider spread for
# ShareGPT.
DATASETS = {
    # name: (prompt_mean, output_mean, sigma of log-length)
    "ShareGPT": (161.0, 338.0, 1.0),
    "Alpaca": (161.0 / 8.4, 338.0 / 5.8, 0.6),
}


@dataclass(frozen=True)
class TraceRequest:
    """One request of a synthetic trace: its lengths, all the waste model needs (not the
    scheduler's `Request` of Chapter 3, which carries tokens and state)."""

    prompt_len: int
    output_len: int


def synthetic_trace(dataset: str, num_requests: int = 2000, seed: int = 0) -> list[TraceRequest]:
    """Deterministic trace: same (dataset, num_requests, seed) -> same list.
    Every request has prompt >= 1, output >= 1 and prompt + output <= MAX_LEN."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {dataset!r}")
    p_mean, o_mean, sigma = DATASETS[dataset]
    rng = np.random.default_rng(seed)

    def lognormal(mean):  # parametrised so that E[X] = mean
        return rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, num_requests)

    prompts = np.clip(np.rint(lognormal(p_mean)), 1, MAX_LEN // 2).astype(int)
    outputs = np.clip(np.rint(lognormal(o_mean)), 1, MAX_LEN - prompts).astype(int)
    return [TraceRequest(int(p), int(o)) for p, o in zip(prompts, outputs)]


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def allocation(scheme: str, req: TraceRequest, used: np.ndarray) -> np.ndarray:
    """Slots allocated to `req` in each iteration, given used(t) per iteration."""
    if scheme == "Orca (Max)":
        return np.full_like(used, MAX_LEN)
    if scheme == "Orca (Pow2)":
        # Never past the model's max length, which the reservation cannot exceed.
        return np.full_like(used, min(req.prompt_len + next_pow2(req.output_len), MAX_LEN))
    if scheme == "Orca (Oracle)":
        return np.full_like(used, req.prompt_len + req.output_len)
    if scheme.startswith("Paged (B="):
        b = int(scheme[len("Paged (B="):-1])
        return -(-used // b) * b
    raise ValueError(f"unknown scheme {scheme!r}")


SCHEMES = ("Orca (Max)", "Orca (Pow2)", "Orca (Oracle)") + tuple(f"Paged (B={b})" for b in PAGED_BLOCK_SIZES)


def used_slots(req: TraceRequest) -> np.ndarray:
    """used(t) = P + t - 1 for t = 1..O."""
    return req.prompt_len + np.arange(req.output_len)


def measure(trace: list[TraceRequest], scheme: str) -> dict:
    """Slot-iteration totals of one scheme over a trace, plus the largest
    per-request slack alloc(t) - used(t) seen (for the one-block bound)."""
    used_sum = alloc_sum = reserved_sum = 0
    max_slack = 0
    for req in trace:
        used = used_slots(req)
        alloc = allocation(scheme, req, used)
        final = req.prompt_len + req.output_len - 1  # most states ever held
        used_sum += int(used.sum())
        alloc_sum += int(alloc.sum())
        reserved_sum += int((np.minimum(alloc, final) - used).sum())
        max_slack = max(max_slack, int((alloc - used).max()))
    return {
        "scheme": scheme,
        "effective_pct": 100.0 * used_sum / alloc_sum,
        "reserved_pct": 100.0 * reserved_sum / alloc_sum,
        "internal_frag_pct": 100.0 * (alloc_sum - used_sum - reserved_sum) / alloc_sum,
        "max_slack_per_request": max_slack,
    }


def waste_table(num_requests: int = 2000, seed: int = 0) -> list[dict]:
    """One row per (dataset, scheme); percentages of allocated slot-iterations."""
    rows = []
    for dataset in DATASETS:
        trace = synthetic_trace(dataset, num_requests, seed)
        for scheme in SCHEMES:
            rows.append({"dataset": dataset, **measure(trace, scheme)})
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'dataset':<9} {'scheme':<14} {'effective':>9} {'reserved':>9} {'int.frag':>9} {'max slack':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['dataset']:<9} {r['scheme']:<14} {r['effective_pct']:8.1f}% {r['reserved_pct']:8.1f}% "
                     f"{r['internal_frag_pct']:8.1f}% {r['max_slack_per_request']:9d}")
    return "\n".join(lines)


def main() -> None:
    num_requests, seed = 2000, 0
    print("KV-cache memory waste: which share of allocated slots holds real token states?")
    print("(seed 001 §3.3 / Fig. 3.2 reports 20.4%-38.2% effective memory for pre-allocating systems)\n")
    for name, (p, o, s) in DATASETS.items():
        trace = synthetic_trace(name, num_requests, seed)
        print(f"{name:<9} trace: {num_requests} requests, log-normal lengths (sigma {s}), target means "
              f"prompt {p:.0f} / output {o:.0f}; sampled means prompt "
              f"{np.mean([r.prompt_len for r in trace]):.0f} / output {np.mean([r.output_len for r in trace]):.0f}")
    print("\neffective = time-average of used/allocated slots over each request's decode iterations;")
    print("reserved = slots a later token will fill; int.frag = slots never filled;")
    print("max slack = largest alloc - used of one request at one iteration (paged: < block size).\n")
    print(format_table(waste_table(num_requests, seed)))
    print("\nNot modelled: external fragmentation of the Orca allocators (would lower their rows further).")


if __name__ == "__main__":
    main()
