"""Shared by the quantization accuracy tests: measure every (dtype, mode) a threshold table
names with a benchmark's `measure`, and hold one measurement to its thresholds."""
from __future__ import annotations

# A table row: (greedy agreement >=, top-1 agreement >=, top-1 logprob gap <=, perplexity ratio <=).
Thresholds = tuple[float, float, float, float]


def measure_table(measure, target: str, thresholds: dict[tuple[str, str], Thresholds]) -> dict:
    """{(dtype, mode): metrics} for every row of `thresholds`, one `measure` call per dtype."""
    out = {}
    for dtype in dict.fromkeys(d for d, _ in thresholds):
        modes = [m for d, m in thresholds if d == dtype]
        for mode, r in measure(target, dtype, modes, windows=4, seq=256, prompts=8, gen_tokens=24).items():
            out[(dtype, mode)] = r
    return out


def check_thresholds(r: dict, mode: str, limits: Thresholds) -> None:
    greedy, top1, gap, ppl = limits
    report = ", ".join(f"{k}={v:.4f}" for k, v in r.items())
    assert r["greedy_agreement"] >= greedy, f"{mode}: greedy continuations diverge early ({report})"
    assert r["top1_agreement"] >= top1, f"{mode}: teacher-forced top-1 tokens disagree too often ({report})"
    assert r["top1_logprob_gap"] <= gap, f"{mode}: a top-1 logprob moved too far ({report})"
    assert r["ppl"] / r["ppl_ref"] <= ppl, f"{mode}: held-out perplexity grew too much ({report})"
