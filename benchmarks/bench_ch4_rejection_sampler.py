"""Chapter 4 benchmark: rejection-sampler paths side by side, and the n-gram proposer.

1. Per-request reference vs batched PyTorch vs Triton kernel, at batch 64,
   k = 4, vocab 32k, on identical draws (outputs checked equal). Without CUDA
   the kernel runs in Triton's interpreter, which measures the interpreter, not
   the kernel: it is reported for completeness with fewer repeats.
2. n-gram proposer time per step at context 4k, on a repetitive and a random
   token stream, against a brute-force Python scan.
Run: .venv/bin/python benchmarks/bench_ch4_rejection_sampler.py
"""
import time

import torch

from mini_vllm.kernels import prepare_triton

prepare_triton()  # without CUDA: Triton's interpreter, selected before triton is imported
from mini_vllm.kernels.rejection_sampler import rejection_sample_triton  # noqa: E402
from mini_vllm.spec_decode import propose_ngram, rejection_sample, rejection_sample_reference, validate_rejection_inputs
from mini_vllm.spec_decode.random_draws import random_verify_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def timed(fn, repeats):
    """Best of `repeats` single calls: the CPU is shared, and the minimum is the
    least disturbed by other processes."""
    out = fn()  # warm-up (and Triton compilation on GPU)
    best = float("inf")
    for _ in range(repeats):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_sampler(batch=64, k=4, vocab=32_000):
    g = torch.Generator().manual_seed(0)
    # Mixed batch, a quarter greedy; near-agreeing draft so acceptance runs are long.
    args = list(random_verify_batch([k] * batch, vocab, [i % 4 == 0 for i in range(batch)], True, g,
                                    peaked=4.0, draft_jitter=1.0))
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    t_ref, ref = timed(lambda: rejection_sample_reference(*args), 5)
    t_bat, bat = timed(lambda: rejection_sample(*args), 10)
    t_val, _ = timed(lambda: validate_rejection_inputs(*args), 10)
    kernel_repeats = 20 if DEVICE == "cuda" else 2
    # Under the interpreter every Triton op costs Python overhead, so one block
    # spans the whole vocabulary; on a GPU, 1024-wide blocks.
    block_v = 1024 if DEVICE == "cuda" else 32_768
    t_tri, tri = timed(lambda: rejection_sample_triton(*args, block_v=block_v), kernel_repeats)
    assert torch.equal(ref.cpu(), bat.cpu()) and torch.equal(ref.cpu(), tri.cpu()), "paths disagree on identical draws"
    emitted = (ref != -1).sum(1).float().mean().item()
    kernel_kind = "compiled, GPU" if DEVICE == "cuda" else "Triton interpreter, CPU"
    print(f"rejection sampler, batch {batch}, k {k}, vocab {vocab}, device {DEVICE} "
          f"(mean tokens emitted per request {emitted:.2f}):")
    print(f"  input validation alone: {t_val * 1e3:9.2f} ms   (included in both PyTorch paths)")
    print(f"  per-request reference : {t_ref * 1e3:9.2f} ms")
    print(f"  batched PyTorch       : {t_bat * 1e3:9.2f} ms   speedup vs reference x{t_ref / t_bat:.1f}")
    print(f"  Triton ({kernel_kind}): {t_tri * 1e3:9.2f} ms   speedup vs reference x{t_ref / t_tri:.2f}")


def brute_force_ngram(tokens, min_n, max_n, k):
    for n in range(max_n, min_n - 1, -1):
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[len(tokens) - n:]:
                return tokens[i + n:i + n + k]
    return []


def bench_ngram(context=4096, k=4, min_n=1, max_n=3):
    g = torch.Generator().manual_seed(1)
    phrase = torch.randint(0, 32_000, (64,), generator=g).tolist()
    repetitive = (phrase * (context // 64 + 1))[:context]
    random_stream = torch.randint(0, 32_000, (context,), generator=g).tolist()
    print(f"n-gram proposer, context {context}, n {min_n}..{max_n}, k {k}:")
    for name, toks in (("repetitive", repetitive), ("random", random_stream)):
        t_vec, got = timed(lambda: propose_ngram(toks, min_n, max_n, k), 50)
        t_bf, want = timed(lambda: brute_force_ngram(toks, min_n, max_n, k), 3)
        assert list(got) == want
        print(f"  {name:10s}: vectorised {t_vec * 1e3:7.3f} ms/step, brute-force Python {t_bf * 1e3:8.3f} ms/step "
              f"(x{t_bf / t_vec:.1f}), draft length {len(got)}")


if __name__ == "__main__":
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    bench_sampler()
    bench_ngram()
