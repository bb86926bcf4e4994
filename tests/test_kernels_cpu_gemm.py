"""The C++ linear layer (kernels/csrc/cpu_gemm.h), bf16 and fp32, as the engine's layers
call it through `mini_vllm.models.cpu_ops.linear`.

Oracles: the exact (fp64) product of the same operands, which every output must be within
the fp32-sum (and, in bf16, one-rounding) bound of; and in bf16 torch's fp32 product
rounded to bf16, which the kernel differs from only in the order of the fp32 sum, so rarely.
Then what the engine relies on: a row's bits do not depend on the rows beside it or on
how the output's panels are split between threads (batch invariance), the packed copy
follows the weight, and shapes the kernel does not take go to oneDNN (or, for bf16 on a
CPU whose oneDNN packs no bf16, F.linear), still correct.

Every test runs once per C++ build this CPU runs (`native_isa`): on an AVX2-only CPU the
AVX2 build, which reads the bf16 weight, widens it in registers and accumulates in fp32.
"""
from __future__ import annotations

import pytest
import torch

from mini_vllm.kernels import cpu_layer_ops_native as native, cpu_native
from mini_vllm.models import cpu_ops
from mini_vllm.models.linear import ColumnParallelLinear
from kernel_cases import native_isa, torch_threads  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("native_isa")

# Summation order moves a value near a rounding boundary: 2 in 10,000 outputs differed
# from torch's with K = 1,024; more than 1 in 1,000 is a real bug.
MAX_FRACTION = 1e-3


def _layer(n_in: int, n_out: int, bias: bool, seed: int = 0, dtype=torch.bfloat16) -> ColumnParallelLinear:
    g = torch.Generator().manual_seed(seed)
    layer = ColumnParallelLinear(n_in, n_out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=g) / n_in ** 0.5)
        if bias:
            layer.bias.copy_(torch.randn(n_out, generator=g))
    return layer.to(dtype)


def _x(rows: int, n_in: int, seed: int = 1, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(rows, n_in, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _oracle(layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    out = x.float() @ layer.weight.float().T
    return (out + layer.bias.float() if layer.bias is not None else out).bfloat16()


def _fraction_differing(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.view(torch.int16) != b.view(torch.int16)).float().mean())


def _run(layer, x):
    with torch.inference_mode():
        return layer(x)


def _uses_the_kernel(layer) -> bool:
    return layer._packed is not None and layer._packed[0][-1]


def _within_the_rounding_bound(layer, x, got) -> float:
    """The largest |got - exact| over its bound: the fp32 sum's order error (at most
    (K + 1) * 2^-24 * sum |x w| + |b|) plus, in bf16, one rounding (2^-8 of the result).
    Where the bias cancels the sum, one fp32 ulp of the sum is many bf16 steps of the
    small result, so a count of steps is no bound there; this is."""
    w = layer.weight.double()
    exact, scale = x.double() @ w.T, x.double().abs() @ w.abs().T
    if layer.bias is not None:
        exact, scale = exact + layer.bias.double(), scale + layer.bias.double().abs()
    order = (x.shape[-1] + 1) * 2.0 ** -24 * scale
    bound = order + (2.0 ** -8 if got.dtype == torch.bfloat16 else 0.0) * (exact.abs() + order)
    return float(((got.double() - exact).abs() / bound).max())


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 16, 130])
@pytest.mark.parametrize("n_in,n_out,bias", [(2, 64, True), (64, 96, False), (1030, 256, True), (1024, 512, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_matches_the_exact_product(rows, n_in, n_out, bias, dtype):
    layer, x = _layer(n_in, n_out, bias, dtype=dtype), _x(rows, n_in, dtype=dtype)
    got = _run(layer, x)
    assert _uses_the_kernel(layer), f"a {dtype} layer of N % 32 == 0 (and even K) must run the C++ kernel here"
    ratio = _within_the_rounding_bound(layer, x, got)
    fraction = _fraction_differing(got, _oracle(layer, x)) if dtype == torch.bfloat16 else 0.0
    assert ratio <= 1 and fraction <= MAX_FRACTION, (
        f"{dtype} rows={rows} K={n_in} N={n_out} bias={bias}: an output is {ratio:.2f}x its rounding bound from the "
        f"exact product and {fraction:.2%} differ from torch's fp32 product rounded to bf16 (a half-panel, a tail "
        "tile, an input (pair) or the bias computed wrong)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_gives_every_row_the_same_bits_in_any_batch(dtype):
    """Rows are computed in tiles of 8 and chunks that fit L2: a row in the tail tile, in a
    full tile or alone must come out the same. All 130 rows against each computed alone."""
    layer, x = _layer(2048, 256, bias=True, seed=2, dtype=dtype), _x(130, 2048, seed=3, dtype=dtype)
    together = _run(layer, x)
    for i in range(130):
        alone = _run(layer, x[i:i + 1])
        assert torch.equal(together[i:i + 1], alone), (
            f"row {i} differs alone and in a batch of 130: the kernel (or the choice of kernel) depends on the "
            "row count, so a request's tokens would depend on its batch")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_threads_give_one_threads_bits(monkeypatch, dtype):
    """Threads split the output's panels; each output is computed the same whichever thread
    does it. 300 rows x 40 panels, the split forced for every call."""
    monkeypatch.setattr(native, "SPLIT_MACS", 1)
    layer, x = _layer(256, 1280, bias=True, dtype=dtype), _x(300, 256, dtype=dtype)
    with torch_threads(1):
        one = _run(layer, x)
    with torch_threads(2):
        two = _run(layer, x)
    assert torch.equal(one, two), "2 threads differ from 1: panels skipped, repeated or mixed up in the split"
    assert _within_the_rounding_bound(layer, x, two) <= 1, "the split computed wrong outputs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_and_batched_inputs(dtype):
    layer = _layer(64, 96, bias=True, dtype=dtype)
    wide = _x(10, 100, dtype=dtype)
    rows = wide[:, 20:84]  # a row stride of 100, not 64
    torch.testing.assert_close(_run(layer, rows), _run(layer, rows.contiguous()), rtol=0, atol=0,
                               msg="x's row stride was ignored")
    x3 = _x(12, 64, dtype=dtype).view(3, 4, 64)
    got = _run(layer, x3)
    assert got.shape == (3, 4, 96), f"a [3, 4, 64] input gave {tuple(got.shape)}"
    torch.testing.assert_close(got.view(12, 96), _run(layer, x3.reshape(12, 64)), rtol=0, atol=0)


@pytest.mark.parametrize("n_in,n_out,dtype", [(64, 40, torch.bfloat16), (63, 64, torch.bfloat16),
                                              (64, 40, torch.float32)])
def test_shapes_the_kernel_does_not_take_go_to_onednn(n_in, n_out, dtype):
    layer, x = _layer(n_in, n_out, bias=True, dtype=dtype), _x(5, n_in, dtype=dtype)
    got = _run(layer, x)
    assert not _uses_the_kernel(layer), f"K={n_in} N={n_out} needs whole panels of 32 and pairs of inputs"
    assert _within_the_rounding_bound(layer, x, got) <= 1, "oneDNN's fallback computed wrong outputs"


def test_the_packed_weight_follows_writes_and_the_kernel_switch(monkeypatch):
    layer, x = _layer(64, 64, bias=False), _x(3, 64)
    _run(layer, x)
    with torch.no_grad():
        layer.weight.zero_()
    assert torch.count_nonzero(_run(layer, x)) == 0, "a stale packed weight was used after weight.zero_()"
    calls = []
    real = native.linear
    monkeypatch.setattr(native, "linear", lambda *a: calls.append(1) or real(*a))
    with cpu_native.numba_only():  # the C++ kernels off: oneDNN's packing, or F.linear where it packs no bf16
        _run(layer, x)
        assert not calls, "with the C++ kernels off the layer still ran the C++ linear"
        if torch.bfloat16 in cpu_ops.PACKABLE:
            assert not _uses_the_kernel(layer), "with the C++ kernels off the layer kept the C++ panels"
    _run(layer, x)
    assert calls and _uses_the_kernel(layer), "with the C++ kernels back on the layer did not return to them"


def test_pack_layout():
    """bf16: panel p, pair kp holds [column c][t] = W[32p + c][2kp + t]; fp32: panel p, input
    k holds [column c] = W[32p + c][k] (csrc/cpu_gemm.h)."""
    w = torch.arange(64 * 6, dtype=torch.float32).view(64, 6)
    packed = native.pack_linear_weight(w.bfloat16())
    assert packed.shape == (2, 3, 32, 2)
    for p, kp, c, t in [(0, 0, 0, 1), (1, 2, 31, 0), (1, 0, 5, 1), (0, 2, 17, 0)]:
        assert packed[p, kp, c, t] == w[32 * p + c, 2 * kp + t], f"bf16 packed[{p}, {kp}, {c}, {t}] is misplaced"
    packed = native.pack_linear_weight(w)
    assert packed.shape == (2, 6, 32)
    for p, k, c in [(0, 0, 1), (1, 5, 31), (1, 2, 0)]:
        assert packed[p, k, c] == w[32 * p + c, k], f"fp32 packed[{p}, {k}, {c}] is misplaced"


def test_compiled_op_runs_the_same_kernel():
    """The traced graph's `mini_vllm::packed_linear` must give eager's bits (the compiled
    and the eager model must not part on a rounding step)."""
    layer, x = _layer(128, 96, bias=True), _x(9, 128)
    eager = _run(layer, x)
    with torch.inference_mode():
        op = torch.ops.mini_vllm.packed_linear(x, layer.weight, layer.bias, layer._packed_name)
    assert torch.equal(op, eager), "mini_vllm::packed_linear and the eager linear take different kernels"
