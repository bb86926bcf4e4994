"""Comparing the course's engine with real vLLM, position by position.

Used by `tests/test_vs_vllm.py` and by the side-by-side benchmarks before they time anything.

Both engines compute in fp32 but not in the same order (vLLM's CPU kernels fuse and
tile differently), so two logits that are almost equal can swap places. When that
happens the argmax legitimately differs and everything after it is a different
continuation. The rule: a request is compared up to the first generated position where
vLLM's own top-2 logprob margin is below `TIE_MARGIN`; positions before it must match
exactly (tokens) and closely (top-k logprobs, `LOGPROB_TOL`). A test also asserts that
such ties cut off no more than 10% of all positions, so the rule cannot hollow it out.
"""
from __future__ import annotations

TIE_MARGIN = 1e-4
LOGPROB_TOL = 1e-4
# bf16 (the Qwen3-0.6B workload): both engines round every activation to 8 bits of
# mantissa, in different places, so logits carry errors of about 2**-8 of their size
# through 28 layers. Set from the largest difference measured between the two
# engines on that workload's first positions (see bench_engine_throughput.py).
BF16_TIE_MARGIN = 0.05
BF16_LOGPROB_TOL = 0.05


def tie_cut(vllm_logprobs, n_tokens: int, margin: float = TIE_MARGIN) -> int:
    """Number of leading positions that are safe to compare (no near-tie in vLLM's top-2)."""
    if vllm_logprobs is None:
        return n_tokens
    for i, row in enumerate(vllm_logprobs[:n_tokens]):
        top = sorted((lp for _, lp, _ in row), reverse=True)
        if len(top) >= 2 and top[0] - top[1] < margin:
            return i
    return n_tokens


def compare_completion(want: dict, got: dict, where: str, top_k: int = 0, margin: float = TIE_MARGIN,
                       tol: float = LOGPROB_TOL) -> tuple[int, int, list[str]]:
    """(positions compared, positions in all, problems) for one completion."""
    wt, gt = want["token_ids"], got["token_ids"]
    cut = tie_cut(want.get("logprobs"), len(wt), margin)
    problems = []
    for i in range(cut):
        if i >= len(gt) or gt[i] != wt[i]:
            seen = gt[i] if i < len(gt) else "nothing (ended early)"
            problems.append(f"{where}: token {i} is {seen}, vLLM has {wt[i]} "
                            f"(vLLM {wt[:i + 1]}, engine {gt[:i + 1]})")
            return cut, len(wt), problems
        if top_k and want.get("logprobs") is not None:
            problems += compare_top_k(want["logprobs"][i], got["logprobs"][i], top_k, f"{where} token {i}", tol)
    if cut == len(wt) and len(gt) != len(wt):
        problems.append(f"{where}: engine generated {len(gt)} tokens, vLLM {len(wt)} "
                        f"(finish {got.get('finish_reason')!r} vs vLLM's {want.get('finish_reason')!r})")
    return cut, len(wt), problems


def compare_top_k(want_row, got_row, k: int, where: str, tol: float = LOGPROB_TOL) -> list[str]:
    """vLLM's top-k (rank <= k) must appear in the engine's top-k with logprobs within
    LOGPROB_TOL; a token may be missing only where it ties the k-th value (an order swap)."""
    if got_row is None:
        return [f"{where}: engine returned no logprobs"]
    got = {t: lp for t, lp, r in got_row if r <= k}
    if len(got) < k:
        return [f"{where}: engine returned {len(got)} top logprobs, asked for {k}"]
    kth = min(got.values())
    out = []
    for t, lp, r in want_row:
        if r > k:
            continue
        if t not in got:
            if abs(lp - kth) > tol:
                out.append(f"{where}: vLLM's rank-{r} token {t} ({lp:.6f}) is not in the engine's top {k}")
        elif abs(got[t] - lp) > tol:
            out.append(f"{where}: logprob of token {t} is {got[t]:.6f}, vLLM {lp:.6f} "
                       f"(diff {abs(got[t] - lp):.2e} > {tol})")
    return out


def compare_phase(want_phase: dict, got_phase: dict, top_k: int = 0,
                  fields=("finish_reason", "stop_reason", "text"), margin: float = TIE_MARGIN,
                  tol: float = LOGPROB_TOL) -> tuple[int, int, list[str]]:
    """Compares every completion of a phase; `fields` must be equal where no tie cut."""
    compared = total = 0
    problems: list[str] = []
    for r, (w, g) in enumerate(zip(want_phase["results"], got_phase["results"])):
        if len(w["outputs"]) != len(g["outputs"]):
            problems.append(f"request {r}: {len(g['outputs'])} completions, vLLM {len(w['outputs'])}")
            continue
        for c, (wc, gc) in enumerate(zip(w["outputs"], g["outputs"])):
            where = f"{want_phase['name']} request {r} completion {c}"
            n, t, p = compare_completion(wc, gc, where, top_k, margin, tol)
            compared, total, problems = compared + n, total + t, problems + p
            if n == t and not p:
                for f in fields:
                    if wc.get(f) != gc.get(f):
                        problems.append(f"{where}: {f} is {gc.get(f)!r}, vLLM {wc.get(f)!r}")
    return compared, total, problems


def compare_prompt_logprobs(want_rows, got_rows, k: int, where: str) -> list[str]:
    """Prompt logprobs: position 0 has none (no token predicts it); every later position's
    top-k as in `compare_top_k`, and the prompt token's own logprob (listed even when it
    ranks below k) within LOGPROB_TOL."""
    if got_rows is None:
        return [f"{where}: engine returned no prompt logprobs"]
    if len(got_rows) != len(want_rows):
        return [f"{where}: {len(got_rows)} prompt positions, vLLM {len(want_rows)}"]
    if got_rows[0] is not None:
        return [f"{where}: the first prompt token has a logprob; vLLM gives None (nothing predicts it)"]
    out = []
    for i in range(1, len(want_rows)):
        out += compare_top_k(want_rows[i], got_rows[i], k, f"{where} prompt position {i}")
        got = {t: lp for t, lp, _ in got_rows[i]}
        for t, lp, r in want_rows[i]:
            if r > k and (t not in got or abs(got[t] - lp) > LOGPROB_TOL):
                out.append(f"{where} prompt position {i}: logprob of the prompt token {t} is "
                           f"{got.get(t)}, vLLM {lp:.6f}")
        if out:
            return out
    return out
