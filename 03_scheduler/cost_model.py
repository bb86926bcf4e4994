"""A model-free step-time model for the simulator:

    step_time = a + b * tokens + c * kv_tokens_read

`tokens` is Σ Δ_r of the step (every token goes through the MLP-like
matmuls); `kv_tokens_read` is the KV entries the attention reads: each new
token at position p reads the p + 1 entries before it (causal), so a request
with c computed tokens and Δ new ones reads Δ·c + Δ(Δ+1)/2 (`kv_read`). A
decode reads its whole context; a prefill's cost grows with Δ². The constants are fitted by non-negative
least squares on *this* CPU by timing (1) Chapter 1's reference
`paged_attention_varlen` over a paged cache and (2) an MLP-shaped workload
x[tokens, d] @ W1[d, 4d] @ W2[4d, d] — a one-layer stand-in for a model.
Real GPUs have other constants; the *shape* (fixed overhead, compute per
token, memory per KV token read) is what the scheduler experiments need.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from mini_vllm.paged_attention import allocate_kv_cache, paged_attention_varlen


@dataclass(frozen=True)
class CostModel:
    a: float  # seconds per step
    b: float  # seconds per scheduled token
    c: float  # seconds per KV token read

    def step_time(self, tokens: int, kv_tokens: int) -> float:
        return self.a + self.b * tokens + self.c * kv_tokens


# The fit the chapter's experiments use, so that their numbers reproduce to the
# digit: `fit_cost_model(measure_grid())` on the course's 2-core CPU on
# 2026-11-22 (R^2 = 0.987), while other jobs shared the machine. Fits on the
# same CPU idle gave a = 0.74-1.04 ms, b = 8.7-13.9 us, c = 29-83 ns: a timing
# fit moves with the load, so the notebook shows a live fit beside this one.
REFERENCE_COST = CostModel(a=1.824e-3, b=23.81e-6, c=45.13e-9)


def kv_read(num_computed: int, delta: int) -> int:
    """KV entries read by Δ causal query tokens after num_computed cached ones."""
    return delta * num_computed + delta * (delta + 1) // 2


def _time_step(q_lens, ctx_lens, d=256, heads=4, block_size=16, reps=3) -> float:
    hd = d // heads
    ntok = sum(q_lens)
    nblk = sum(-(-c // block_size) for c in ctx_lens)
    kc, vc = allocate_kv_cache(nblk, block_size, heads, hd)
    tables, pos = [], 0
    width = max(-(-c // block_size) for c in ctx_lens)
    for c in ctx_lens:
        n = -(-c // block_size)
        tables.append(list(range(pos, pos + n)) + [0] * (width - n))
        pos += n
    bt = torch.tensor(tables, dtype=torch.int32)
    cu = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32)
    sl = torch.tensor(ctx_lens, dtype=torch.int32)
    q = torch.randn(ntok, heads, hd)
    x = torch.randn(ntok, d)
    w1, w2 = torch.randn(d, 4 * d), torch.randn(4 * d, d)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        (x @ w1).relu_() @ w2
        paged_attention_varlen(q, kc, vc, bt, cu, sl, hd ** -0.5)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_grid(seed: int = 0):
    """(tokens, kv_tokens_read, seconds) for decode, prefill and mixed
    batches, timed single-threaded (best of 3) to damp noise from other jobs."""
    rng = np.random.default_rng(seed)
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n_seqs in (1, 2, 4, 8):
            for kind in ("decode", "prefill", "mixed"):
                ctx = [int(c) for c in rng.integers(16, 384, n_seqs)]
                if kind == "decode":
                    q = [1] * n_seqs
                elif kind == "prefill":
                    q = list(ctx)
                else:
                    q = [1 if i % 2 else c for i, c in enumerate(ctx)]
                kv = sum(kv_read(c - d, d) for c, d in zip(ctx, q))
                rows.append((sum(q), kv, _time_step(q, ctx)))
    finally:  # the caller's thread count survives an error (or Ctrl-C) too
        torch.set_num_threads(threads)
    return rows


def fit_cost_model(rows) -> tuple[CostModel, float]:
    """Non-negative least squares (a, b, c >= 0) and the R² of the fit.

    Solved as NNLS (`scipy.optimize.nnls`), not as an unconstrained fit
    clamped afterwards: clamping a negative coefficient to 0 leaves the
    others at values fitted alongside it, which is not the best fit. The
    columns are scaled to unit norm first (token counts and KV reads differ
    by orders of magnitude) and the coefficients scaled back.
    """
    from scipy.optimize import nnls

    t, kv, y = (np.array(v, dtype=float) for v in zip(*rows))
    A = np.stack([np.ones_like(t), t, kv], axis=1)
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0  # an all-zero column gets coefficient 0 either way
    coef = nnls(A / norms, y)[0] / norms
    pred = A @ coef
    r2 = 1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    return CostModel(*map(float, coef)), float(r2)
