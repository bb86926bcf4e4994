"""The CPU path of a mixture-of-experts layer against the reference loop, side by side.

vLLM counterpart: `vllm/model_executor/layers/fused_moe/experts/cpu_moe.py`
(the CPU build's grouped GEMM) against a loop over experts.

Shapes: Qwen3-30B-A3B's routing (64 experts, top-8) at a narrowed width
(hidden 512, expert intermediate 256), fp32 and bf16, decode-like batches
(1, 4, 16, 64 tokens) and a prefill-like one (512). The 64 experts' weights
(96 MiB in fp32, 48 in bf16) outgrow the L3, so a decode step reads its
experts' weights from memory, as a served model does. Routing: softmax top-8
of random router logits, renormalised.

Columns, milliseconds per call (best of REPEATS, the versions alternating so
background load hits all of them), after each was checked against the
reference: the reference loop (`fused_experts_reference`); the grouped path
with F.linear (`kernels/cpu_fused_moe.py` with the C++ kernels off, as under
MINI_VLLM_CPU_ATTN=numba); the grouped path on the C++ GEMM (what
`dispatch.fused_experts` runs on CPU tensors); then reference / C++.
Also printed: tokens per busy expert (T * k / busy experts).

Run: flock /tmp/bench.lock .venv/bin/python benchmarks/bench_fused_moe.py [--threads 1,2]
"""
from __future__ import annotations

import argparse
import time

import torch

from machine import machine_line
from mini_vllm.kernels import cpu_native
from mini_vllm.kernels.cpu_fused_moe import fused_experts_cpu
from mini_vllm.models.fused_moe import fused_experts_reference, fused_topk_reference

HIDDEN, INTER, EXPERTS, TOP_K = 512, 256, 64, 8
TOKENS = (1, 4, 16, 64, 512)
REPEATS = 10


def best(fns, repeats: int) -> list[float]:
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [min(ts) * 1e3 for ts in times]


def grouped_torch(*args):
    with cpu_native.numba_only():
        return fused_experts_cpu(*args)


def row(tokens: int, dtype) -> tuple[float, list[float]]:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5).to(dtype)
    weights, ids = fused_topk_reference(torch.randn(tokens, EXPERTS, generator=g), TOP_K, renormalize=True)
    args = (x, w13, w2, weights, ids)
    want = fused_experts_reference(*args).float()
    tol = (1e-5 if dtype == torch.float32 else 3e-2) * max(1.0, want.abs().max().item())
    for name, fn in (("grouped F.linear", grouped_torch), ("grouped C++", fused_experts_cpu)):
        err = (fn(*args).float() - want).abs().max().item()
        assert err <= tol, f"{name} differs from the reference by {err:.3g} > {tol:.3g} ({tokens} tokens, {dtype})"
    per_expert = tokens * TOP_K / ids.unique().numel()
    return per_expert, best([lambda: fused_experts_reference(*args), lambda: grouped_torch(*args),
                             lambda: fused_experts_cpu(*args)], REPEATS if tokens <= 64 else 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    print(machine_line(threads))
    print(f"C++ kernels: {cpu_native.isa() or 'off: ' + str(cpu_native.unavailable_reason())}")
    print(f"H={HIDDEN} I={INTER} E={EXPERTS} k={TOP_K}")
    with torch.inference_mode(False), torch.no_grad():
        for n in threads:
            torch.set_num_threads(n)
            for dtype in (torch.float32, torch.bfloat16):
                print(f"\n{n} thread(s), {str(dtype)[6:]}: reference ms | grouped F.linear ms | grouped C++ ms "
                      f"(reference / C++)   tokens per busy expert")
                for tokens in TOKENS:
                    per_expert, (ref, tor, cpp) = row(tokens, dtype)
                    print(f"  T={tokens:<4} {ref:9.3f} | {tor:9.3f} | {cpp:9.3f}  ({ref / cpp:5.2f}x)   {per_expert:6.1f}")


if __name__ == "__main__":
    main()
