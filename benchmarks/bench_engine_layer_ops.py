"""The engine's fused CPU layer ops against the torch code they replace, and
oneDNN's packed linear against F.linear, side by side in one run.

vLLM counterparts: `csrc/cpu/layernorm.cpp`, `activation.cpp`,
`pos_encoding.cpp` (the fused ops) and `dispatch_cpu_unquantized_gemm` in
`vllm/model_executor/layers/utils.py` (oneDNN with packed weights).

Shapes: tiny-py-target's (hidden 256, intermediate 768, 4 query heads of 64,
qkv 512 wide, vocabulary 6,144), fp32, for a 2,048-token prefill step and a
128-sequence decode step. Each op is checked against its reference first, then
timed (best of REPEATS, the two versions alternating so background load hits
both), after one untimed pass over everything. Printed: milliseconds and torch / fused (or F.linear / oneDNN).

Then the fused ops' two implementations, numba's loops against the C++ ops
(kernels/cpu_layer_ops_native.py, where this CPU runs them), on a Qwen3-0.6B-shaped
bf16 model's widths (hidden 1,024, intermediate 3,072, 16 + 8 heads of 128): a
16-sequence decode step and a 1,259-token prefill (the qwen3-0.6b workload's).
Microseconds, the whole call (checks, allocation, dispatch) included, since on a
decode step that is most of it.

Last, the bf16 linear layers of that model: oneDNN's packed matmul (F.linear on a CPU
whose oneDNN packs no bf16: AVX2 only) against the C++ kernel (kernels/csrc/cpu_gemm.h)
that `cpu_ops.linear` runs where this CPU has AVX512_BF16 or AVX2 + FMA (the build is
printed), for 1 and 16 rows (decode) and 1,259 (the prefill). Each call cycles
through COPIES copies of the weight, more than a server L3 holds, so a decode step
reads its weights from memory as the engine's does. Milliseconds per call, GB/s of
weight read or GFLOP/s.

Run: .venv/bin/python benchmarks/bench_engine_layer_ops.py [--threads 1,2]
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F

from mini_vllm.kernels import cpu_layer_ops as L, cpu_layer_ops_native as native, cpu_native
from mini_vllm.models import cpu_ops
from mini_vllm.models.layers import RMSNorm
from mini_vllm.models.linear import ColumnParallelLinear
from mini_vllm.models.rotary import RotaryEmbedding

REPEATS = 50


def best_pair(ref, new, repeats: int = REPEATS) -> tuple[float, float]:
    ref(), new()
    a, b = [], []
    for _ in range(repeats):
        for fn, ts in ((ref, a), (new, b)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return min(a) * 1e3, min(b) * 1e3


def rows(tokens: int) -> list[tuple[str, float, float]]:
    g = torch.Generator().manual_seed(tokens)
    x, r = torch.randn(tokens, 256, generator=g), torch.randn(tokens, 256, generator=g)
    norm = RMSNorm(256)
    gate_up = torch.randn(tokens, 1536, generator=g)
    rope = RotaryEmbedding(64, 1024, 10000.0)
    pos = torch.randint(0, 1024, (tokens,), generator=g)
    q = torch.randn(tokens, 512, generator=g)[:, :256]  # a column slice of qkv, as in the model
    gate, up = gate_up.chunk(2, dim=-1)

    def torch_rope():
        cos, sin = rope.cos_cache[pos][:, None, :], rope.sin_cache[pos][:, None, :]
        return rope._rotate(q, cos, sin)

    layers = {}
    for name, n_in, n_out in (("qkv_proj", 256, 512), ("gate_up_proj", 256, 1536), ("down_proj", 768, 256),
                              ("lm_head", 256, 6144)):
        layers[name] = ColumnParallelLinear(n_in, n_out)  # built outside inference_mode, as a loaded model is
        torch.nn.init.normal_(layers[name].weight)
    out = []
    with torch.inference_mode():
        torch.testing.assert_close(L.fused_add_rms_norm(x, r, norm.weight, 1e-6)[0], norm._norm(x + r))
        out.append(("add + RMSNorm",) + best_pair(lambda: norm._norm(x + r),
                                                  lambda: L.fused_add_rms_norm(x, r, norm.weight, 1e-6)))
        torch.testing.assert_close(L.silu_and_mul(gate_up), F.silu(gate) * up)
        out.append(("SiLU-and-mul",) + best_pair(lambda: F.silu(gate) * up, lambda: L.silu_and_mul(gate_up)))
        assert torch.equal(L.rotary_embedding(pos, q, rope.cos_cache, rope.sin_cache, 64), torch_rope())
        out.append(("rotary (q)",) + best_pair(torch_rope,
                                              lambda: L.rotary_embedding(pos, q, rope.cos_cache, rope.sin_cache, 64)))
        for name, layer in layers.items():
            n_out, n_in = layer.weight.shape
            h = torch.randn(tokens, n_in, generator=g)
            torch.testing.assert_close(cpu_ops.linear(h, layer.weight, None, layer), F.linear(h, layer.weight),
                                       rtol=1e-4, atol=1e-3)
            out.append((f"linear {name} {n_in}x{n_out}",) + best_pair(
                lambda: F.linear(h, layer.weight), lambda: cpu_ops.linear(h, layer.weight, None, layer)))
    return out


def native_rows(tokens: int) -> list[tuple[str, float, float]]:
    """(op, numba ms, C++ ms) on Qwen3-0.6B's bf16 widths."""
    g, dt = torch.Generator().manual_seed(tokens), torch.bfloat16
    x, r = (torch.randn(tokens, 1024, generator=g).to(dt) for _ in range(2))
    weight, q_w, k_w = (torch.randn(n, generator=g).to(dt) for n in (1024, 128, 128))
    gate_up, qkv = torch.randn(tokens, 6144, generator=g).to(dt), torch.randn(tokens, 4096, generator=g).to(dt)
    rope = RotaryEmbedding(128, 4096, 1000000.0)
    pos = torch.randint(0, 4096, (tokens,), generator=g)
    ops = {"add + RMSNorm": lambda: L.fused_add_rms_norm(x, r, weight, 1e-6),
           "SiLU-and-mul": lambda: L.silu_and_mul(gate_up),
           "q/k norm + rotary": lambda: L.qk_norm_rope(pos, qkv, 16, 8, 128, q_w, k_w, 1e-6, rope.cos_cache,
                                                       rope.sin_cache)}

    def numba_only(fn):
        def run():
            with cpu_native.numba_only():
                return fn()
        return run

    return [(name,) + best_pair(numba_only(fn), fn) for name, fn in ops.items()]


COPIES = 4  # of each weight: 4 x 12.6 MB for gate_up, past a 32 MB L3
QWEN3_LINEARS = (("qkv_proj", 1024, 4096), ("o_proj", 2048, 1024), ("gate_up_proj", 1024, 6144),
                 ("down_proj", 3072, 1024), ("lm_head", 1024, 151936))


def linear_rows(tokens: int) -> list[tuple[str, float, float, float, float]]:
    """(layer, oneDNN ms, C++ ms, bytes, flops) per call on Qwen3-0.6B's bf16 linears."""
    g, out = torch.Generator().manual_seed(tokens), []
    for name, n_in, n_out in QWEN3_LINEARS:
        if name == "lm_head" and tokens > 16:
            continue  # a prefill runs the lm_head on each sequence's last token only
        copies = COPIES if n_in * n_out * 2 < 64 << 20 else 1  # the lm_head alone is 311 MB
        # Each side its own layers: a layer keeps one packed copy, for the kernel that last ran it.
        sides = [[ColumnParallelLinear(n_in, n_out, bias=False) for _ in range(copies)] for _ in range(2)]
        for layer in sides[0] + sides[1]:
            torch.nn.init.normal_(layer.weight, std=n_in ** -0.5)
            layer.to(torch.bfloat16)
        h = torch.randn(tokens, n_in, generator=g).bfloat16()

        def run(native_on: bool):
            layers = sides[native_on]
            kernels = contextlib.nullcontext if native_on else cpu_native.numba_only  # C++ off: oneDNN / F.linear

            def call():
                with kernels():
                    for layer in layers:
                        cpu_ops.linear(h, layer.weight, None, layer)
            return call

        with torch.inference_mode():
            layer = sides[1][0]
            ref = F.linear(h.float(), layer.weight.float())
            got = cpu_ops.linear(h, layer.weight, None, layer)
            assert layer._packed[0][-1], "the C++ bf16 linear did not run"
            torch.testing.assert_close(got.float(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
            a, b = best_pair(run(False), run(True), repeats=REPEATS if tokens <= 16 else 5)
        out.append((f"{name} {n_in}x{n_out}", a / copies, b / copies, n_in * n_out * 2, 2 * tokens * n_in * n_out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    # One untimed pass first: the first large allocations of a process page-fault (glibc
    # serves them with fresh mmaps until a free raises its threshold), which would be
    # charged to whichever op happens to run first.
    for tokens in (2048, 128):
        rows(tokens)
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for tokens in (2048, 128):
            print(f"\n{threads} thread(s), {tokens} tokens: torch ms -> fused/oneDNN ms (torch / fused)")
            for name, a, b in rows(tokens):
                print(f"  {name:<28} {a:7.3f} -> {b:7.3f}  ({a / b:.2f}x)")
        if not native.handles(torch.bfloat16):
            print(f"\nthe C++ layer ops do not run here: {cpu_native.unavailable_reason() or 'build failed'}")
            continue
        for tokens in (16, 1259):
            print(f"\n{threads} thread(s), Qwen3-0.6B bf16, {tokens} tokens: numba us -> C++ us (numba / C++)")
            for name, a, b in native_rows(tokens):
                print(f"  {name:<28} {a * 1e3:7.1f} -> {b * 1e3:7.1f}  ({a / b:.2f}x)")
        for tokens in (1, 16, 1259):
            unit = "GB/s" if tokens <= 16 else "GFLOP/s"
            base = "oneDNN" if torch.bfloat16 in cpu_ops.PACKABLE else "F.linear"
            print(f"\n{threads} thread(s), Qwen3-0.6B bf16 linears, {tokens} rows: {base} ms -> C++ ms "
                  f"({base} / C++, the {cpu_native.isa()} build), {unit}")
            for name, a, b, nbytes, flops in linear_rows(tokens):
                rate = (lambda ms: nbytes / ms / 1e6) if tokens <= 16 else (lambda ms: flops / ms / 1e6)
                print(f"  {name:<28} {a:7.3f} -> {b:7.3f}  ({a / b:.2f}x)  {rate(a):6.1f} -> {rate(b):6.1f}")


if __name__ == "__main__":
    main()
