"""Chapter 4: how often does the lossless test cry wolf, and how often does it catch a lossy sampler?

The test in tests/test_ch4_lossless.py (chi-square per emitted position,
Bonferroni over positions, family-wise ALPHA = 1e-5, N = 10 000 requests) is
run R times on random (p, q) pairs:
- on the correct sampler: the rejection rate is the empirical false-positive
  rate. At 1e-5 none are expected in R runs, so the p-values are also checked
  for calibration at looser levels (a valid test rejects about `level` of runs);
- on two lossy controls: the rejection rate is the power.
Run: .venv/bin/python benchmarks/bench_ch4_lossless_fpr.py [--runs R]  (default 100, about a
minute on an idle 2-core CPU; the chapter notes quote --runs 300)
"""
import argparse
import time

import torch

from mini_vllm.spec_decode import lossy, rejection_sample
from mini_vllm.spec_decode.stats import position_pvalues, simulate_identical_requests

ALPHA, N = 1e-5, 10_000


def random_case(g):
    vocab = int(torch.randint(2, 17, (1,), generator=g))
    k = int(torch.randint(1, 5, (1,), generator=g))
    conc = float(torch.empty(1).uniform_(0.3, 3.0, generator=g))
    gamma = lambda rows: torch._standard_gamma(torch.full((rows, vocab), conc))  # noqa: E731
    p, q = gamma(k + 1), gamma(k)
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def family_min_p(out, p):
    """Smallest Bonferroni-adjusted p-value over positions (reject when < level)."""
    pv = position_pvalues(out, p)
    return min(min(x * len(pv) for x in pv), 1.0) if pv else 1.0


def main(RUNS):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    levels = (0.05, 0.01, 1e-3, ALPHA)
    results = {name: [] for name in ("correct", "accept_always", "recover_from_target")}
    samplers = {"correct": rejection_sample, "accept_always": lossy.accept_always,
                "recover_from_target": lossy.recover_from_target}
    t = time.perf_counter()
    for _ in range(RUNS):
        p, q = random_case(g)
        for name, fn in samplers.items():
            out = simulate_identical_requests(p, q, N, fn, g)
            results[name].append(family_min_p(out, p))
    print(f"lossless test: chi-square per position, Bonferroni, N = {N}, {RUNS} random (p, q) pairs, "
          f"vocab 2..16, k 1..4 ({time.perf_counter() - t:.0f} s)")
    for name, adj in results.items():
        adj = torch.tensor(adj)
        rates = "  ".join(f"rejected at {lv:g}: {int((adj < lv).sum())}/{RUNS} ({(adj < lv).float().mean():.4f})" for lv in levels)
        print(f"  {name:20s} {rates}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    main(parser.parse_args().runs)
