"""The fused CPU layer ops (kernels/cpu_layer_ops.py) and the CPU dispatch of
the model's layers (models/cpu_ops.py: oneDNN linears, fused ops), each
against the torch code it replaces, which stays the reference.

Each op test runs on both implementations (the `impl` fixture): the C++ ops
(kernels/cpu_layer_ops_native.py) in each build this CPU runs (AVX-512 with BF16,
AVX2 + FMA), and the numba loops."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mini_vllm.kernels import cpu_layer_ops as L, cpu_layer_ops_native as native, cpu_native
from mini_vllm.models import cpu_ops
from mini_vllm.models.layers import ParallelLMHead, RMSNorm, SiluAndMul
from mini_vllm.models.linear import ColumnParallelLinear, RowParallelLinear
from mini_vllm.models.rotary import RotaryEmbedding
from kernel_cases import native_builds, native_isa, torch_threads  # noqa: F401 (native_isa: a fixture)

SHAPES = [(1, 8), (7, 64), (300, 256), (33, 96)]


@pytest.fixture(scope="module", params=[*(f"cpp-{b}" if b else "cpp" for b in native_builds()), "numba"])
def impl_name(request):
    """Module-scoped, so that pytest runs every op test's C++ runs before any numba run: in a
    fresh copy (a mutant's) numba compiles each loop on its first call, 10-20 s in all, and
    the C++ ops' mistakes are then found first. It enters no context itself (`impl` does),
    so the tests beside it run as they would alone."""
    return request.param


@pytest.fixture
def impl(impl_name):
    """The op tests run once per C++ build this CPU runs (cpu_native.use_isa), and on the numba
    loops (the reference on every CPU, forced with cpu_native.numba_only)."""
    if impl_name.startswith("cpp"):
        build = impl_name[4:] or None
        if build is None:
            pytest.skip(f"the C++ layer ops do not run here: {cpu_native.unavailable_reason()}")
        with cpu_native.use_isa(build):
            if not native.handles(torch.float32):
                pytest.skip(f"the C++ layer ops' {build} build failed")
            yield impl_name
    else:
        with cpu_native.numba_only():
            assert not native.handles(torch.float32)
            yield "numba"


def _norm_module(hidden: int, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm


@pytest.mark.parametrize("tokens,hidden", SHAPES)
@pytest.mark.usefixtures("impl")
def test_rms_norm_matches_torch(tokens, hidden):
    g = torch.Generator().manual_seed(tokens * hidden)
    x, residual = torch.randn(tokens, hidden, generator=g) * 3, torch.randn(tokens, hidden, generator=g)
    norm = _norm_module(hidden, 1)
    with torch.no_grad():
        ref = norm._norm(x)
        got = L.rms_norm(x, norm.weight, norm.eps)
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6,
                                   msg="rms_norm differs from RMSNorm._norm: wrong mean (sum / hidden), eps or weight")
        ref_out, ref_res = norm._norm(x + residual), x + residual
        out, res = L.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(res, ref_res), "fused_add_rms_norm must return x + residual as the new residual"
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6,
                               msg="fused_add_rms_norm must normalise x + residual, not x")
    assert not torch.equal(out, L.rms_norm(x, norm.weight, norm.eps)), "the residual was not added before the norm"


@pytest.mark.parametrize("tokens,inter", [(1, 4), (5, 768), (129, 100)])
@pytest.mark.usefixtures("impl")
def test_silu_and_mul_matches_torch(tokens, inter):
    x = torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 6
    x[0, 0], x[-1, 1] = 100.0, -100.0  # far tails: exp clamped, silu(100) = 100, silu(-100) ~ 0
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(L.silu_and_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6,
                               msg="silu_and_mul must be silu([gate]) * [up] with gate the FIRST half")


# (3, 1, 1024): a head over the C++ rotation's largest (MAX_HEAD_SIZE) takes the numba loop.
@pytest.mark.parametrize("tokens,heads,head_size", [(1, 1, 8), (9, 4, 64), (40, 2, 128), (3, 1, 1024)])
@pytest.mark.usefixtures("impl")
def test_rotary_embedding_equals_torch_bit_for_bit(tokens, heads, head_size):
    rope = RotaryEmbedding(head_size, 512, 10000.0)
    g = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    wide = torch.randn(tokens, 2 * heads * head_size, generator=g)
    q = wide[:, :heads * head_size]  # a column slice, as q is of the qkv projection: rows strided
    cos, sin = rope.cos_cache[positions][:, None, :], rope.sin_cache[positions][:, None, :]
    got = L.rotary_embedding(positions, q, rope.cos_cache, rope.sin_cache, head_size)
    assert torch.equal(got, rope._rotate(q, cos, sin)), \
        "rotary_embedding differs from RotaryEmbedding._rotate (neox halves, position row, or fused multiply-add)"
    assert torch.equal(wide[:, :heads * head_size], q), "rotary_embedding must not write its input"


def _bf16_steps(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """(largest difference in bf16 rounding steps, fraction of elements that differ).
    Pairs that are both below 1e-30 in magnitude count as equal: silu(-100) is -0.0
    in torch and -6e-37 here (the kernels' exp clamps its argument at 88), nothing
    a model can tell from 0, but millions of rounding steps apart."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    tiny = (a.float().abs() < 1e-30) & (b.float().abs() < 1e-30)
    ai, bi = torch.where(tiny, 0, ai), torch.where(tiny, 0, bi)
    return int((ai - bi).abs().max()), float((ai != bi).float().mean())


# RMSNorm sums in another order than torch's mean and SiLU uses the kernels' exp, so a
# value within an fp32 ulp of a bf16 rounding boundary may round the other way: one step,
# rarely. More than one step, or more than 1 element in 1,000, is a real difference.
BF16_MAX_FRACTION = 1e-3


@pytest.mark.parametrize("tokens,hidden", [(1, 8), (7, 128), (37, 1024)])
@pytest.mark.usefixtures("impl")
def test_bf16_norms_match_torch_within_one_rounding(tokens, hidden):
    g = torch.Generator().manual_seed(tokens + hidden)
    x = (torch.randn(tokens, hidden, generator=g) * 3).bfloat16()
    residual = torch.randn(tokens, hidden, generator=g).bfloat16()
    norm = _norm_module(hidden, 2).bfloat16()
    with torch.no_grad():
        got, ref = L.rms_norm(x, norm.weight, norm.eps), norm._norm(x)
        out, res = L.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        ref_out, ref_res = norm._norm(x + residual), x + residual
    assert got.dtype == torch.bfloat16 and out.dtype == res.dtype == torch.bfloat16, "bf16 in, bf16 out"
    assert torch.equal(res, ref_res), "the new residual must be x + residual rounded to bf16, as torch's add"
    for name, a, b in (("rms_norm", got, ref), ("fused_add_rms_norm", out, ref_out)):
        steps, frac = _bf16_steps(a, b)
        assert steps <= 1 and frac <= BF16_MAX_FRACTION, (
            f"bf16 {name} differs from RMSNorm._norm by {steps} rounding steps in {frac:.2%} of elements: "
            "rounded at other points than torch (normalised value, then times the weight) or not to nearest even")


@pytest.mark.parametrize("tokens,inter", [(1, 4), (33, 3072)])
@pytest.mark.usefixtures("impl")
def test_bf16_silu_and_mul_matches_torch_within_one_rounding(tokens, inter):
    x = (torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 6).bfloat16()
    x[0, 0], x[-1, 1] = 100.0, -100.0
    gate, up = x.chunk(2, dim=-1)
    got = L.silu_and_mul(x)
    steps, frac = _bf16_steps(got, F.silu(gate) * up)
    assert steps <= 1 and frac <= BF16_MAX_FRACTION, (
        f"bf16 silu_and_mul differs from torch by {steps} rounding steps in {frac:.2%} of elements: "
        "silu(gate) must be rounded to bf16 before the product")


@pytest.mark.parametrize("tokens,heads,head_size", [(1, 1, 8), (40, 16, 128)])
@pytest.mark.usefixtures("impl")
def test_bf16_rotary_embedding_equals_torch_bit_for_bit(tokens, heads, head_size):
    rope = RotaryEmbedding(head_size, 2048, 1000000.0)
    g = torch.Generator().manual_seed(tokens + 7)
    positions = torch.randint(0, 2048, (tokens,), generator=g)
    q = torch.randn(tokens, 2 * heads * head_size, generator=g).bfloat16()[:, :heads * head_size]
    cos = rope.cos_cache[positions].to(q.dtype)[:, None, :]
    sin = rope.sin_cache[positions].to(q.dtype)[:, None, :]
    got = L.rotary_embedding(positions, q, rope.cos_cache, rope.sin_cache, head_size)
    assert torch.equal(got, rope._rotate(q, cos, sin)), (
        "bf16 rotary_embedding differs from torch: cos/sin must be rounded to bf16, and each product "
        "rounded before the difference and the sum")


def _qwen3_qkv(tokens: int, heads: int, kv_heads: int, head_size: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=g) * 3).to(dtype)
    q_w, k_w = (torch.randn(head_size, generator=g).to(dtype) for _ in range(2))
    return g, qkv, q_w, k_w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_size", [(1, 1, 1, 8), (9, 4, 2, 64), (37, 16, 8, 128)])
@pytest.mark.usefixtures("impl")
def test_qk_norm_rope_equals_the_ops_apart_and_torch(dtype, tokens, heads, kv_heads, head_size):
    """Qwen3's fused q/k norm + rotation against (1) rms_norm per head then rotary_embedding,
    bit for bit (same rounding points), and (2) the torch code of the model's layers."""
    g, qkv, q_w, k_w = _qwen3_qkv(tokens, heads, kv_heads, head_size, dtype, tokens + heads)
    rope = RotaryEmbedding(head_size, 2048, 1000000.0)
    positions = torch.randint(0, 2048, (tokens,), generator=g)
    q, k, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    got_q, got_k = L.qk_norm_rope(positions, qkv, heads, kv_heads, head_size, q_w, k_w, 1e-6,
                                  rope.cos_cache, rope.sin_cache)
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.dtype == got_k.dtype == dtype
    for name, x, w, got in (("q", q, q_w, got_q), ("k", k, k_w, got_k)):
        normed = L.rms_norm(x.reshape(-1, head_size), w, 1e-6).view(tokens, -1)
        apart = L.rotary_embedding(positions, normed, rope.cos_cache, rope.sin_cache, head_size)
        assert torch.equal(got, apart), (
            f"{dtype} qk_norm_rope's {name} differs from rms_norm then rotary_embedding: the wrong heads "
            f"(q's and k's weights or offsets mixed up), the norm after the rotation, or other rounding points")
        norm = RMSNorm(head_size, 1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(w)
            ref_normed = norm._norm(x.reshape(tokens, -1, head_size)).view(tokens, -1)
        cos = rope.cos_cache[positions].to(dtype)[:, None, :]
        sin = rope.sin_cache[positions].to(dtype)[:, None, :]
        ref = rope._rotate(ref_normed, cos, sin)
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5,
                                       msg=f"fp32 qk_norm_rope's {name} differs from the torch layers")
        else:
            steps, frac = _bf16_steps(got, ref)
            assert steps <= 2 and frac <= 2 * BF16_MAX_FRACTION, (
                f"bf16 qk_norm_rope's {name} differs from the torch layers by {steps} rounding steps in {frac:.2%} "
                "of elements (one norm rounding step, carried through the rotation, is allowed)")


def test_bf16_rounding_is_to_nearest_even_and_keeps_nan():
    """The narrowing every bf16 op ends with, against torch's own conversion, on the
    values where rounding modes differ: exact ties (round to the even mantissa),
    just above and below a tie, the largest finite values, infinities and NaN."""
    tie = 1.0 + 2.0 ** -8  # halfway between 1 and the next bf16
    vals = [tie, -tie, 1.0 + 3 * 2.0 ** -8, tie + 2.0 ** -20, tie - 2.0 ** -20, 3.3895e38, 3.39e38,
            float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40]
    x = torch.tensor(vals, dtype=torch.float32)
    want = x.bfloat16().view(torch.int16).numpy().view(np.uint16)
    from mini_vllm.kernels.cpu_layer_ops_bf16 import _fp32_to_bf16
    got = np.array([_fp32_to_bf16(np.float32(v)) for v in vals], dtype=np.uint16)
    nan = np.isnan(np.array(vals))
    assert (got[~nan] == want[~nan]).all(), \
        f"fp32 -> bf16 rounding differs from torch's: {list(got[~nan])} vs {list(want[~nan])}"
    # torch's NaN bits depend on its code path (0x7FC0 scalar, 0xFFFF vectorised): a NaN is what counts
    assert all((g & 0x7F80) == 0x7F80 and (g & 0x7F) for g in got[nan]), "NaN must stay NaN, not become inf"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("impl")
def test_two_threads_give_one_threads_bits(dtype, monkeypatch):
    """Each op splits its rows between torch's threads; a row's arithmetic is
    the same whichever thread does it, so 2 threads give 1 thread's bits. A
    split that skipped or repeated a slice of rows, or a worker reading the
    wrong row, would differ (300 rows: both threads get some). The C++ ops split
    only large calls: here every call is split."""
    monkeypatch.setattr(native, "SPLIT_ELEMENTS", 1)
    g = torch.Generator().manual_seed(11)
    x, residual = torch.randn(300, 256, generator=g).to(dtype), torch.randn(300, 256, generator=g).to(dtype)
    weight = torch.randn(256, generator=g).to(dtype)
    gate_up = torch.randn(300, 2 * 96, generator=g).to(dtype)
    rope = RotaryEmbedding(64, 512, 10000.0)
    positions = torch.randint(0, 512, (300,), generator=g)
    calls = {
        "rms_norm": lambda: (L.rms_norm(x, weight, 1e-6),),
        "fused_add_rms_norm": lambda: L.fused_add_rms_norm(x, residual, weight, 1e-6),
        "silu_and_mul": lambda: (L.silu_and_mul(gate_up),),
        "rotary_embedding": lambda: (L.rotary_embedding(positions, x, rope.cos_cache, rope.sin_cache, 64),),
        "qk_norm_rope": lambda: L.qk_norm_rope(positions, x, 2, 1, 64, weight[:64], weight[64:128], 1e-6,
                                               rope.cos_cache, rope.sin_cache),
    }
    for name, call in calls.items():
        with torch_threads(1):
            one = call()
        with torch_threads(2):
            two = call()
        for a, b in zip(one, two):
            assert torch.equal(a, b), \
                f"{dtype} {name}: 2 threads differ from 1 (rows skipped, repeated or mixed up in the split)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [16, 300])
@pytest.mark.usefixtures("native_isa")
def test_cpp_ops_equal_the_numba_ops(dtype, tokens):
    """The C++ ops against the numba loops on Qwen3-0.6B's widths (hidden 1,024,
    intermediate 3,072, 16 + 8 heads of 128): a decode step's 16 rows, run on the
    calling thread, and 300 rows, split between threads. The rotation is bit for
    bit; a norm may differ by one rounding of its sum of squares (summed in another
    order), SiLU by one ulp of its exp (other multiply-adds), and in bf16 that is one
    rounding step of the output, rarely."""
    if not native.handles(dtype):
        pytest.skip(f"the C++ layer ops do not run here: {cpu_native.unavailable_reason() or 'build failed'}")
    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, 1024, generator=g) * 3).to(dtype)
    residual = torch.randn(tokens, 1024, generator=g).to(dtype)
    weight, q_w, k_w = (torch.randn(n, generator=g).to(dtype) for n in (1024, 128, 128))
    gate_up = (torch.randn(tokens, 2 * 3072, generator=g) * 4).to(dtype)
    qkv = (torch.randn(tokens, 32 * 128, generator=g) * 2).to(dtype)
    rope = RotaryEmbedding(128, 4096, 1000000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    calls = {
        "rms_norm": lambda: (L.rms_norm(x, weight, 1e-6),),
        "fused_add_rms_norm": lambda: L.fused_add_rms_norm(x, residual, weight, 1e-6),
        "silu_and_mul": lambda: (L.silu_and_mul(gate_up),),
        "rotary_embedding": lambda: (L.rotary_embedding(positions, qkv[:, :2048], rope.cos_cache, rope.sin_cache,
                                                        128),),
        "qk_norm_rope": lambda: L.qk_norm_rope(positions, qkv, 16, 8, 128, q_w, k_w, 1e-6, rope.cos_cache,
                                               rope.sin_cache),
    }
    for name, call in calls.items():
        with torch_threads(2):
            cpp = call()
            with cpu_native.numba_only():
                ref = call()
        for a, b in zip(cpp, ref):
            if name == "rotary_embedding":
                assert torch.equal(a, b), "C++ rotary_embedding differs from numba's: other rounding points"
            elif dtype == torch.bfloat16:
                # A norm's one-step difference, rotated: where a * cos and b * sin nearly cancel
                # it is many steps of the small result, so it is bounded against the row's scale.
                steps, frac = _bf16_steps(a, b)
                worst = (a.float() - b.float()).abs().max().item()
                assert frac <= BF16_MAX_FRACTION and (steps <= 1 or worst <= 2 ** -7 * b.float().abs().max().item()), (
                    f"C++ bf16 {name} differs from numba's by {steps} rounding steps (at most {worst:.3g}) "
                    f"in {frac:.2%} of elements")
            else:
                torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6, msg=f"C++ fp32 {name} differs from numba's")


@pytest.mark.usefixtures("impl")
def test_bad_inputs_are_refused_by_name():
    rope = RotaryEmbedding(8, 16, 10000.0)
    with pytest.raises(IndexError, match="outside the cos/sin table"):
        L.rotary_embedding(torch.tensor([16]), torch.randn(1, 8), rope.cos_cache, rope.sin_cache, 8)
    with pytest.raises(ValueError, match="positions must be"):
        L.rotary_embedding(torch.tensor([1, 2]), torch.randn(1, 8), rope.cos_cache, rope.sin_cache, 8)
    with pytest.raises(ValueError, match="x must be a float32 or bfloat16"):
        L.rms_norm(torch.randn(2, 8).half(), torch.ones(8).half(), 1e-6)
    with pytest.raises(ValueError, match="weight must be a contiguous torch.bfloat16"):
        L.rms_norm(torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-6)  # a bf16 model's norm weight is bf16
    with pytest.raises(ValueError, match="residual must be a torch.float32"):
        L.fused_add_rms_norm(torch.randn(2, 8), torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        L.rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"\[tokens, 8\]"):
        L.rms_norm(torch.randn(2, 6), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="one shape"):
        L.fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="even"):
        L.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match=r"qkv must be \[tokens, 32\]"):  # 2 + 2 * 1 heads of 8
        L.qk_norm_rope(torch.arange(2), torch.randn(2, 24), 2, 1, 8, torch.ones(8), torch.ones(8), 1e-6,
                       rope.cos_cache, rope.sin_cache)
    with pytest.raises(IndexError, match="outside the cos/sin table"):
        L.qk_norm_rope(torch.tensor([16]), torch.randn(1, 32), 2, 1, 8, torch.ones(8), torch.ones(8), 1e-6,
                       rope.cos_cache, rope.sin_cache)
    with pytest.raises(ValueError, match="k_weight must be a contiguous torch.float32 CPU vector of 8"):
        L.qk_norm_rope(torch.arange(2), torch.randn(2, 32), 2, 1, 8, torch.ones(8), torch.ones(4), 1e-6,
                       rope.cos_cache, rope.sin_cache)


def test_layers_take_the_fused_path_only_where_it_applies(monkeypatch):
    calls = []
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"):
        real = getattr(L, name)
        monkeypatch.setattr(L, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    norm, act, rope = _norm_module(16, 2), SiluAndMul(), RotaryEmbedding(8, 32, 10000.0)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        norm(x), norm(x, x), act(x), rope(torch.arange(3), x, x)
    assert calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "rotary_embedding"], \
        f"fp32 CPU inference must use the fused ops, called {calls}"
    calls.clear()
    norm16 = _norm_module(16, 2).bfloat16()
    with torch.inference_mode():
        xb = x.bfloat16()
        norm16(xb), norm16(xb, xb), act(xb), rope(torch.arange(3), xb, xb)
    assert calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "rotary_embedding"], \
        f"bf16 CPU inference (a bf16 model) must use the fused ops, called {calls}"
    calls.clear()
    with torch.inference_mode():
        norm(x.bfloat16()), act(x.double()), act(x.half())  # a bf16 x with an fp32 weight: mixed, torch's rules
    out = norm(x)  # autograd on: the fused op has no backward
    out.sum().backward()
    assert calls == [] and norm.weight.grad is not None, \
        f"mixed dtypes, fp64, fp16 and autograd must keep the torch path (fused calls: {calls})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_attention_takes_the_fused_qk_path(monkeypatch, dtype):
    """Qwen3's q/k norms and rotation: one qk_norm_rope call in CPU inference, close to the
    model's torch code; the torch code under autograd (the fused op has no backward)."""
    from mini_vllm.course.tiny_models import model_path
    from mini_vllm.models.loader import load_model

    model, _ = load_model(model_path("tiny-py-target"), dtype=dtype, attention_backend="torch")
    attn = model.model.layers[1].self_attn
    calls = []
    real = L.qk_norm_rope
    monkeypatch.setattr(L, "qk_norm_rope", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(3)
    qkv = (torch.randn(5, attn.q_size + 2 * attn.kv_size, generator=g) * 2).to(dtype)
    positions = torch.tensor([0, 1, 2, 700, 1023])

    def run(x):
        q, k, _ = x.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        return attn.position_qk(positions, x, q, k)

    with torch.inference_mode():
        fused = run(qkv)
    assert calls == [1], "Qwen3 CPU inference must norm and rotate q and k in one qk_norm_rope call"
    monkeypatch.setattr(cpu_ops, "CPU_OPS", "torch")
    with torch.inference_mode():
        ref = run(qkv)
    assert calls == [1], "MINI_VLLM_CPU_OPS=torch must keep the model's torch code"
    for name, a, b in zip("qk", fused, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-5 if dtype == torch.float32 else 0.07,
                                   msg=f"{dtype} fused {name} differs from Qwen3Attention's torch code")
    monkeypatch.setattr(cpu_ops, "CPU_OPS", "compiled")
    grad_in = qkv.float().requires_grad_() if dtype == torch.float32 else None
    if grad_in is not None:
        run(grad_in)[0].sum().backward()
        assert calls == [1] and grad_in.grad is not None, "autograd must keep the torch path"


def _column(n_in: int, n_out: int, bias: bool) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(n_in, n_out, bias=bias)
    g = torch.Generator().manual_seed(n_in + n_out)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(n_out, generator=g))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_linear_matches_f_linear(dtype):
    layer = _column(64, 96, bias=True).to(dtype)
    x = torch.randn(20, 64).to(dtype)
    with torch.inference_mode():
        got = layer(x)
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * 8,
                               msg="the packed linear must compute x @ W.T + b")
    packed = layer._packed is not None
    if native.handles_linear(x, layer.weight) or (cpu_ops._AVAILABLE and dtype in cpu_ops.PACKABLE):
        assert packed, "fp32 and bf16 CPU inference must use the packed weight where the C++ kernel or oneDNN takes it"
    else:  # bf16 on a CPU with no C++ build, where oneDNN's bf16 reorder raises
        assert not packed, f"{dtype} was packed although this CPU cannot pack it"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gives_a_row_the_same_bits_in_any_batch(dtype):
    """The engine's outputs must not depend on how requests are batched: a row's
    product through `cpu_ops.linear` is the same bits with 1, 2, 3 or 130 rows
    in the call. (F.linear breaks this: the BLAS takes a 1-row kernel; choosing
    it for small batches was measured faster and made the core-process test's
    logprobs differ.)"""
    layer = _column(256, 512, bias=True).to(dtype)
    x = torch.randn(130, 256).to(dtype)
    with torch.inference_mode():
        alone = layer(x[:1])
        for rows in (2, 3, 16, 130):
            assert torch.equal(layer(x[:rows])[:1], alone), (
                f"{dtype}: row 0's product changed with {rows} rows in the call: the linear's path or kernel "
                "depends on the batch size, so a request's tokens would depend on its batch")


def test_packed_weight_follows_in_place_writes():
    """A weight written after the first call (a test zeroing a projection, a
    reload) must be packed again: a cached copy keyed on the object alone would
    keep computing with the old weight."""
    layer = _column(32, 48, bias=False)
    x = torch.randn(4, 32)
    with torch.inference_mode():
        layer(x)
    with torch.no_grad():
        layer.weight.zero_()
    with torch.inference_mode():
        assert torch.count_nonzero(layer(x)) == 0, "a stale packed weight was used after weight.zero_()"
    with torch.no_grad():
        layer.weight.data = torch.ones(48, 32)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), x.sum(-1, keepdim=True).expand(4, 48), rtol=1e-5, atol=1e-5,
                                   msg="a stale packed weight was used after weight.data was replaced")


def test_a_weight_made_under_inference_mode_takes_f_linear():
    """Inference tensors have no version counter, so a packed copy of one could
    go stale unnoticed: such a layer must run F.linear, not crash or pack."""
    with torch.inference_mode():
        layer = _column(16, 24, bias=True)
        x = torch.randn(3, 16)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    assert layer._packed is None, "an inference-mode weight was packed"


def test_row_parallel_and_tied_lm_head_use_the_same_dispatch():
    row = RowParallelLinear(32, 16, bias=True)
    head = ParallelLMHead(40, 32)
    with torch.no_grad():
        for t in (row.weight, row.bias, head.weight):
            t.normal_()
    x = torch.randn(5, 32)
    with torch.inference_mode():
        torch.testing.assert_close(row(x), F.linear(x, row.weight, row.bias), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(head(x), F.linear(x, head.weight), rtol=1e-5, atol=1e-4)


def test_cpu_ops_switch_is_validated_and_honoured():
    code = "import mini_vllm.models.cpu_ops as c; print(c.CPU_OPS, c.fused(__import__('torch').ones(1)))"
    bad = subprocess.run([sys.executable, "-c", code], env={"MINI_VLLM_CPU_OPS": "fast", "PATH": ""},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "MINI_VLLM_CPU_OPS must be one of ('compiled', 'torch'), got 'fast'" in bad.stderr
    off = subprocess.run([sys.executable, "-c", code], env={"MINI_VLLM_CPU_OPS": "torch", "PATH": ""},
                         capture_output=True, text=True, check=True)
    assert off.stdout.split() == ["torch", "False"], "MINI_VLLM_CPU_OPS=torch must turn the fused ops off"


_FIRST_LINEAR = """
import os, torch
from mini_vllm.models import cpu_ops
from mini_vllm.models.linear import ColumnParallelLinear
layer = ColumnParallelLinear(64, 32, bias=False)
with torch.no_grad():
    layer(torch.randn(3, 64))
print(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), cpu_ops.PRIMITIVE_CACHE_CAPACITY)
"""


@pytest.mark.skipif(not cpu_ops._AVAILABLE, reason="no oneDNN linear in this torch build")
@pytest.mark.parametrize("preset", [None, "77"])
def test_the_first_packed_linear_sizes_onednns_primitive_cache(preset):
    """A fresh process: the first packed weight raises oneDNN's primitive cache (read when
    oneDNN makes its first primitive) so that a step's varying row counts do not rebuild
    matmuls; a capacity the user set is kept."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    if preset:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = preset
    out = subprocess.run([sys.executable, "-c", _FIRST_LINEAR], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen, ours = out.stdout.split()
    want = preset or ours
    assert seen == want, (f"ONEDNN_PRIMITIVE_CACHE_CAPACITY is {seen} after the first linear, want {want}: "
                          "the cache was not sized before oneDNN's first primitive, or a user's value was overwritten")
