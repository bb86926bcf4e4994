"""Weight-only int8 linears (kernels/cpu_int8_linear.py) against the engine's unquantized ones,
side by side in one run, on a Qwen3-0.6B-shaped model's layers.

vLLM counterpart: vLLM's CPU int8 path (`kernels/linear/scaled_mm/cpu.py`, oneDNN or
sgl-kernels W8A8); here int8 weights with activations in the model's dtype.

Compared, per layer shape (hidden 1,024, intermediate 3,072, 16 + 8 + 8 heads of 128) and row
count (1 and 16: decode steps; 256: a prefill chunk):
* bf16 -> int8: the engine's bf16 linear (`cpu_ops.linear`: the C++ kernel where this CPU runs
  it, else oneDNN or F.linear) against the int8 kernel on the same bf16 rows;
* fp32 -> int8: the same in fp32.
Each call cycles through enough copies of the weight to exceed the L3 cache (COPY_BYTES per
dtype), so a decode step reads its weights from memory, as the engine's does. The two sides
alternate, best of REPEATS. Printed: milliseconds per call, the weight bytes read per second
(decode) or GFLOP/s (prefill), and full precision / int8.

Run: flock /tmp/bench.lock .venv/bin/python benchmarks/bench_int8_linear.py [--threads 1,2]
"""
from __future__ import annotations

import argparse
import time

import torch

from machine import machine_line
from mini_vllm.kernels.cpu_int8_linear import int8_linear
from mini_vllm.models.linear import ColumnParallelLinear
from mini_vllm.models.quantization import quant_utils as qu

SHAPES = {"qkv_proj": (1024, 4096), "o_proj": (2048, 1024), "gate_up_proj": (1024, 6144), "down_proj": (3072, 1024)}
ROWS = (1, 16, 256)
REPEATS = 20
COPY_BYTES = 96 << 20  # per side: past a server's L3


def _copies(nbytes: int) -> int:
    return max(2, -(-COPY_BYTES // nbytes))


def _layers(k: int, n: int, dtype: torch.dtype, copies: int):
    out = []
    with torch.no_grad():
        for _ in range(copies):
            layer = ColumnParallelLinear(k, n).to(dtype)
            layer.weight.normal_(0, 0.02)
            out.append(layer)
    return out


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def rows_for(k: int, n: int, dtype: torch.dtype, rows: int) -> tuple[float, float]:
    """(full-precision ms, int8 ms) per call for one shape."""
    full = _layers(k, n, dtype, _copies(k * n * torch.finfo(dtype).bits // 8))
    quant = []
    for layer in full[: _copies(k * n)]:
        s = qu.int8_weight_scale(layer.weight.detach())
        quant.append((qu.quantize_int8(layer.weight.detach(), s).contiguous(), s))
    x = torch.randn(rows, k).to(dtype)
    with torch.inference_mode():
        ref = full[0](x).float()
        got = int8_linear(x, *quant[0]).float()
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err < 0.05, f"int8 output is {err:.3f} of the output's range away from full precision"
        a_fn = lambda: [layer(x) for layer in full]  # noqa: E731
        b_fn = lambda: [int8_linear(x, q, s) for q, s in quant]  # noqa: E731
        a_fn(), b_fn()
        reps = REPEATS if rows <= 16 else 3
        a = b = float("inf")
        for _ in range(reps):  # alternate, so background load hits both
            a = min(a, _best(a_fn, 1) / len(full))
            b = min(b, _best(b_fn, 1) / len(quant))
    return a * 1e3, b * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    print(machine_line(tuple(threads)))
    for t in threads:
        torch.set_num_threads(t)
        for dtype in (torch.bfloat16, torch.float32):
            name = str(dtype).removeprefix("torch.")
            for rows in ROWS:
                unit = "GB/s of weight" if rows <= 16 else "GFLOP/s"
                print(f"\n{t} thread(s), {name}, {rows} row(s): {name} ms -> int8 ms ({name} / int8), {unit}")
                for lname, (k, n) in SHAPES.items():
                    a, b = rows_for(k, n, dtype, rows)
                    if rows <= 16:
                        ra, rb = k * n * torch.finfo(dtype).bits / 8 / a / 1e6, k * n / b / 1e6
                    else:
                        ra, rb = 2 * rows * k * n / a / 1e6, 2 * rows * k * n / b / 1e6
                    print(f"  {lname:<13} {k}x{n:<5} {a:8.3f} -> {b:8.3f}  ({a / b:5.2f}x)  {ra:7.1f} -> {rb:7.1f}",
                          flush=True)


if __name__ == "__main__":
    main()
