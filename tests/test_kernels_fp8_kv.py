"""fp8 KV cache kernels (`kv_cache_dtype` "fp8" = "fp8_e4m3", "fp8_e5m2") against an oracle.

The oracle (`fp8_oracle.py`) decodes each fp8 byte from its bits and quantises by the
nearest finite value, sharing nothing with torch's float8 casts. Every path is checked:
  * writing: Chapter 1's `reshape_and_cache`, the Triton kernel and the cpu backend's
    `write_kv_in_place` store exactly the oracle's bytes of fp32(x / scale), saturated;
  * reading: Chapter 1's varlen and decode reference, the Triton paged kernel (varlen,
    decode) and split-KV kernel, the numba CPU kernel and the C++ CPU kernel (varlen,
    decode, once per build this CPU runs; its GQA ratios, decodes, chunks and prefill
    tiles, fp32 and bf16 queries, one and two threads) give dense float64 attention over
    the oracle's dequantised K/V (byte value * scale) within fp32 rounding; the C++ kernel
    reads every byte of both formats as exactly fp32(value) * scale.
Scales are far from 1 (k 0.07, v 0.03) and differ, so a scale applied twice, not
applied when reading, or swapped between K and V is caught; caches are NaN outside the
written slots (the fp8 NaN byte), so a read past seq_len shows. Small shapes: the
Triton kernels run in the interpreter here.
"""
import math
import os

import pytest
import torch

import fp8_oracle as oracle
from kernel_cases import native_builds, scrambled_layout, torch_threads
from mini_vllm import paged_attention as ref
from mini_vllm.attention.backends import write_kv_in_place
from mini_vllm.kernels import cpu_native, cpu_paged_attention as cpa
from mini_vllm.kernels import paged_attention as tpa, paged_attention_split as tps
from mini_vllm.kernels.kv_cache_dtype import (FP8_DTYPES, check_kv_cache_dtype, dequantize, quantize,
                                              resolve_kv_cache_dtype)
from mini_vllm.kernels.reshape_and_cache import reshape_and_cache as triton_reshape_and_cache
from oracles import dense_causal_attention

FORMATS = ("e4m3", "e5m2")
K_SCALE, V_SCALE = 0.07, 0.03
NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, BLOCK = 2, 4, 16, 8


def _inputs(n, seed, dtype=torch.float32, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM):
    g = torch.Generator().manual_seed(seed)
    # Magnitudes over several octaves, some past e4m3's range at these scales (saturation).
    k = torch.randn(n, kv_heads, head_dim, generator=g) * torch.exp(torch.randn(n, 1, 1, generator=g))
    k[0, 0, :3] = torch.tensor([40.0, -40.0, 1e-6])  # 40 / 0.07 = 571 > 448: saturates in e4m3
    v = torch.randn(n, kv_heads, head_dim, generator=g)
    return k.to(dtype), v.to(dtype)


def _expected_codes(fmt, x, scale):
    return oracle.quantize_codes(fmt, x.float() / scale)  # x / scale in fp32, then nearest


def test_names_and_formats():
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn, \
        "'fp8' must mean e4m3 (vLLM: fp8 = fp8_e4m3)"
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16, "'auto' is the model's dtype"
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\)"):
        check_kv_cache_dtype("int8")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_matches_the_oracle(fmt):
    x = torch.randn(4096) * torch.exp(torch.randn(4096) * 3)
    got = quantize(x, 0.5, oracle.TORCH[fmt]).view(torch.uint8)
    assert torch.equal(got, _expected_codes(fmt, x, 0.5)), \
        f"{fmt}: stored bytes are not fp8(x / scale) rounded to nearest and saturated (wrong format or scale?)"
    back = dequantize(quantize(x, 0.5, oracle.TORCH[fmt]), 0.5).double()
    assert torch.equal(back, oracle.dequantize_codes(fmt, got, 0.5)), f"{fmt}: dequantised value is not byte * scale"


WRITERS = {
    "reference": lambda k, v, kc, vc, slots: ref.reshape_and_cache(k, v, kc, vc, slots, K_SCALE, V_SCALE),
    "triton": lambda k, v, kc, vc, slots: triton_reshape_and_cache(k, v, kc, vc, slots, K_SCALE, V_SCALE),
    "cpu_backend": lambda k, v, kc, vc, slots: write_kv_in_place(k, v, kc, vc, slots[slots >= 0], slots >= 0,
                                                                 K_SCALE, V_SCALE),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("in_dtype", (torch.float32, torch.bfloat16))
def test_writers_store_the_oracle_bytes(writer, fmt, in_dtype):
    n, num_blocks = 12, 4
    k, v = _inputs(n, seed=1, dtype=in_dtype)
    shape = (num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM)
    kc = torch.full(shape, float("nan")).to(oracle.TORCH[fmt])
    vc = kc.clone()
    slots = torch.tensor([9, 3, -1, 17, 0, 30, 8, -1, 25, 1, 12, 31])
    WRITERS[writer](k, v, kc, vc, slots)
    nan_code = int(torch.tensor(float("nan")).to(oracle.TORCH[fmt]).view(torch.uint8))
    for cache, x, scale, what in ((kc, k, K_SCALE, "key"), (vc, v, V_SCALE, "value")):
        flat = cache.view(torch.uint8).view(-1, NUM_KV_HEADS, HEAD_DIM)
        real = slots >= 0
        want = _expected_codes(fmt, x[real], scale)
        assert torch.equal(flat[slots[real]], want), \
            f"{writer} {fmt} {what}: cached bytes differ from fp8({what} / scale) (scale twice, wrong format?)"
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[real]] = False
        assert bool((flat[untouched] == nan_code).all()), f"{writer}: wrote a slot not in slot_mapping (or slot -1)"


def _paged_case(fmt, seq_lens, q_lens, seed, q_dtype=torch.float32, heads=(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM),
                block=BLOCK):
    """Caches holding the oracle's bytes of random K/V at scrambled blocks (NaN elsewhere),
    the queries, and each sequence's dequantised K/V in float64. heads: (query heads, KV
    heads, head_dim)."""
    num_heads, kv_heads, head_dim = heads
    layout = scrambled_layout(seq_lens, block, seed)
    shape = (layout.num_blocks, block, kv_heads, head_dim)
    nan = int(torch.tensor(float("nan")).to(oracle.TORCH[fmt]).view(torch.uint8))
    kc, vc = torch.full(shape, nan, dtype=torch.uint8), torch.full(shape, nan, dtype=torch.uint8)
    ks, vs, qs = [], [], []
    g = torch.Generator().manual_seed(seed)
    for i, (s, q) in enumerate(zip(seq_lens, q_lens)):
        k, v = _inputs(s, seed + i, kv_heads=kv_heads, head_dim=head_dim)
        kb, vb = _expected_codes(fmt, k, K_SCALE), _expected_codes(fmt, v, V_SCALE)
        for pos in range(s):
            kc[layout.block_tables[i][pos // block], pos % block] = kb[pos]
            vc[layout.block_tables[i][pos // block], pos % block] = vb[pos]
        ks.append(oracle.dequantize_codes(fmt, kb, K_SCALE))
        vs.append(oracle.dequantize_codes(fmt, vb, V_SCALE))
        qs.append(torch.randn(q, num_heads, head_dim, generator=g).to(q_dtype))
    tables = torch.tensor(layout.block_tables, dtype=torch.int32)
    return (kc.view(oracle.TORCH[fmt]), vc.view(oracle.TORCH[fmt]), tables,
            torch.tensor(seq_lens, dtype=torch.int32), ks, vs, qs)


def _varlen(fn):
    return lambda q, kc, vc, t, cu, sl, sc: fn(q, kc, vc, t, cu, sl, sc, k_scale=K_SCALE, v_scale=V_SCALE)


def _decode(fn, **kw):
    return lambda q, kc, vc, t, sl, sc: fn(q, kc, vc, t, sl, sc, k_scale=K_SCALE, v_scale=V_SCALE, **kw)


class _CppCalls:
    """Counts the calls that reach the C++ kernel (cpu_native.run) inside the block."""

    def __init__(self):
        self.count = 0
        self._real = cpu_native.run

    def _counting(self, *args, **kwargs):
        self.count += 1
        return self._real(*args, **kwargs)

    def __enter__(self):
        cpu_native.run = self._counting
        return self

    def __exit__(self, *exc):
        cpu_native.run = self._real


def _numba(fn):
    """fn on the numba kernel (the C++ kernel switched off)."""
    def call(*args):
        with cpu_native.numba_only():
            return fn(*args)
    return call


def _cpp(fn, build):
    """fn on the C++ kernel's build `build` (skipped where no build runs); fails unless the call reached it."""
    def call(*args):
        if build is None:
            pytest.skip(f"the C++ kernels cannot run here: {cpu_native.unavailable_reason()}")
        with cpu_native.use_isa(build), _CppCalls() as calls:
            out = fn(*args)
        assert calls.count, f"an fp8 cache did not reach the C++ kernel ({build} build): routed to numba?"
        return out
    return call


BUILDS = native_builds()  # the C++ builds this CPU runs, or (None,): their tests skipped
CPP = {f"cpp_{b}": b for b in BUILDS}
VARLEN = {"reference": _varlen(ref.paged_attention_varlen), "triton": _varlen(tpa.paged_attention_varlen),
          "numba": _numba(_varlen(cpa.paged_attention_varlen)),
          **{name: _cpp(_varlen(cpa.paged_attention_varlen), b) for name, b in CPP.items()}}
DECODE = {"reference": _decode(ref.paged_attention_decode), "triton": _decode(tpa.paged_attention_decode),
          "triton_split": _decode(tps.paged_attention_decode_split, num_segments=2),
          "numba": _numba(_decode(cpa.paged_attention_decode)),
          **{name: _cpp(_decode(cpa.paged_attention_decode), b) for name, b in CPP.items()}}
TOL = 2e-5  # fp32 arithmetic on exactly dequantised values (outputs of magnitude ~1)


def _check(out, expected, what):
    assert not torch.isnan(out).any(), f"{what}: NaN -> a slot past seq_len (fp8 NaN byte) was read"
    err = (out.double() - expected).abs().max().item()
    assert err <= TOL, (f"{what}: max error {err:.3g} > {TOL} against attention over the dequantised cache "
                        "(scale not applied on reading, applied twice, K/V scales swapped, or wrong fp8 format?)")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", VARLEN)
def test_varlen_reads_dequantised_cache(path, fmt):
    seq_lens, q_lens = (21, 9, 16), (5, 9, 1)  # a chunk after a cached prefix, a whole prefill, a decode
    kc, vc, tables, sl, ks, vs, qs = _paged_case(fmt, seq_lens, q_lens, seed=3)
    cu = torch.tensor([0, 5, 14, 15], dtype=torch.int32)
    scale = 1 / math.sqrt(HEAD_DIM)
    out = VARLEN[path](torch.cat(qs), kc, vc, tables, cu, sl, scale)
    for i in range(3):
        _check(out[cu[i]:cu[i + 1]], dense_causal_attention(qs[i].double(), ks[i], vs[i], scale).double(),
               f"{path} varlen {fmt} seq {i}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", DECODE)
def test_decode_reads_dequantised_cache(path, fmt):
    seq_lens = (37, 5, 16)
    kc, vc, tables, sl, ks, vs, qs = _paged_case(fmt, seq_lens, (1, 1, 1), seed=4)
    scale = 1 / math.sqrt(HEAD_DIM)
    out = DECODE[path](torch.cat(qs), kc, vc, tables, sl, scale)
    for i in range(3):
        _check(out[i:i + 1], dense_causal_attention(qs[i].double(), ks[i], vs[i], scale).double(),
               f"{path} decode {fmt} seq {i}")


@pytest.mark.parametrize("path", ("reference", "triton", "numba", *CPP))
def test_bf16_query_reads_fp8_cache(path):
    """A bf16 model with an fp8 cache: the query stays bf16, the output is bf16: one rounding
    of the fp32 result, at most 2**-8 relative; one bf16 ulp (2**-7) for the Triton kernel
    under the interpreter, whose bf16 conversion truncates."""
    kc, vc, tables, sl, ks, vs, qs = _paged_case("e4m3", (21, 9), (5, 9), seed=5, q_dtype=torch.bfloat16)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    out = VARLEN[path](torch.cat(qs), kc, vc, tables, cu, sl, 0.25)
    assert out.dtype == torch.bfloat16, "the output must have the query's dtype"
    tol = 2 ** -7 if path == "triton" and os.environ.get("TRITON_INTERPRET") == "1" else 2 ** -8
    for i in range(2):
        want = dense_causal_attention(qs[i].double(), ks[i], vs[i], 0.25).double()
        err = ((out[cu[i]:cu[i + 1]].double() - want).abs() / want.abs().clamp(min=0.5)).max().item()
        assert err <= tol, f"{path}: bf16 query over an fp8 cache off by {err:.3g} relative"


def test_cpp_kernel_takes_only_the_fp8_calls_it_reads():
    """The C++ kernel reads an fp8 cache with an fp32 or bf16 query (the model's dtype), a
    head_dim that is a multiple of 16 and scales below 2**120; anything else must go to numba."""
    for dtype in FP8_DTYPES:
        assert not cpu_native.handles(dtype, 64), f"cpu_native claims {dtype} with an fp8 query, which no model has"
        assert not cpu_native.handles(dtype, 64, torch.float16), f"cpu_native claims {dtype} with an fp16 query"
        assert not cpu_native.handles(dtype, 24, torch.float32), "cpu_native claims a head_dim not a multiple of 16"
    assert cpu_native.scales_ok(0.07, 2.0 ** 119) and not cpu_native.scales_ok(2.0 ** 120, 1.0), \
        "scales_ok must refuse a scale whose e4m3 multiplier (scale * 2**8) overflows fp32, and only that"
    if cpu_native.unavailable_reason() is None:
        assert all(cpu_native.handles(d, 64, q) for d in FP8_DTYPES for q in (torch.float32, torch.bfloat16)), \
            "the C++ kernel must take fp8 caches with fp32 and bf16 queries where it runs"
    kc, vc, tables, sl, _, _, qs = _paged_case("e4m3", (9,), (1,), seed=6)
    with _CppCalls() as calls:
        big = cpa.paged_attention_decode(qs[0], kc, vc, tables, sl, 0.25, k_scale=2.0 ** 121, v_scale=V_SCALE)
    assert not calls.count, "a scale scales_ok refuses must take the numba kernel"
    with cpu_native.numba_only():
        want = cpa.paged_attention_decode(qs[0], kc, vc, tables, sl, 0.25, k_scale=2.0 ** 121, v_scale=V_SCALE)
    # (keys of 2**121 * 448 overflow fp32, so some outputs are NaN: compared as numbers)
    assert torch.equal(big.nan_to_num(), want.nan_to_num()), "the numba kernel's result, not the C++ kernel's"


GQA_BATCH = ((40, 37, 45, 19, 16, 33), (1, 37, 11, 1, 1, 20))  # decodes, a whole prefill, chunks


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("q_dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("ratio", (1, 2, 4, 8, 16))
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpp_kernel_every_gqa_ratio_decode_and_prefill(fmt, ratio, q_dtype, build):
    """The C++ kernel's paths over an fp8 cache (decodes of several KV heads, a whole prefill
    and chunks in lane tiles, small chunks row by row; 16 query heads per KV head tile even a
    decode) against dense float64 attention over the oracle's dequantised K/V, head_dim 64,
    block 16. fp32 queries within TOL, bf16 queries and outputs within one rounding (2**-8
    relative), as test_bf16_query_reads_fp8_cache."""
    seq_lens, q_lens = GQA_BATCH
    kc, vc, tables, sl, ks, vs, qs = _paged_case(fmt, seq_lens, q_lens, seed=10 + ratio, q_dtype=q_dtype,
                                                 heads=(2 * ratio, 2, 64), block=16)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = _cpp(_varlen(cpa.paged_attention_varlen), build)(torch.cat(qs), kc, vc, tables, cu, sl, 0.125)
    assert out.dtype == q_dtype, "the output must have the query's dtype"
    for i in range(len(seq_lens)):
        want = dense_causal_attention(qs[i].double(), ks[i], vs[i], 0.125).double()
        got = out[cu[i]:cu[i + 1]]
        what = f"C++ {build} {fmt} ratio {ratio} {q_dtype} seq {i} (q_len {q_lens[i]})"
        if q_dtype == torch.float32:
            _check(got, want, what)
        else:
            err = ((got.double() - want).abs() / want.abs().clamp(min=0.5)).max().item()
            assert err <= 2 ** -8, f"{what}: off by {err:.3g} relative (scale not applied, wrong format?)"


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpp_kernel_reads_every_byte_as_value_times_scale(fmt, build):
    """One cached position: attention returns its V row exactly (one key, softmax weight 1),
    so each of the 256 bytes, one per element of 2 KV heads x 128 dims, must come back as
    fp32(the oracle's value) * v_scale in fp32, bit for bit: subnormals, the largest
    values, signed zeros, and e5m2's inf and NaN codes and e4m3's NaN codes as NaN/inf."""
    codes = torch.arange(256, dtype=torch.uint8).view(1, 1, 2, 128)
    vc = codes.view(oracle.TORCH[fmt])
    kc = torch.zeros_like(codes).view(oracle.TORCH[fmt])
    q = torch.randn(1, 4, 128, generator=torch.Generator().manual_seed(0))
    tables, sl = torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    out = _cpp(_decode(cpa.paged_attention_decode), build)(q, kc, vc, tables, sl, 0.125)
    want = oracle.table(fmt).float().view(2, 128) * torch.tensor(V_SCALE, dtype=torch.float32)
    for h in range(4):  # query head h reads KV head h // 2
        got, w = out[0, h], want[h // 2]
        bad = ~((got == w) | (torch.isnan(got) & torch.isnan(w)))
        assert not bad.any(), (f"C++ {build} {fmt}: bytes {codes.view(2, 128)[h // 2][bad].tolist()} read as "
                               f"{got[bad].tolist()}, want {w[bad].tolist()} (wrong format, scale or special code?)")


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpp_kernel_one_and_two_threads_give_identical_bits(monkeypatch, fmt, build):
    """A row's arithmetic does not depend on which thread takes its item, nor on decodes
    split into items of KV heads: two threads give one thread's bits."""
    seq_lens, q_lens = (70, 33, 90, 12), (1, 33, 1, 1)
    kc, vc, tables, sl, _, _, qs = _paged_case(fmt, seq_lens, q_lens, seed=8, heads=(8, 4, 64), block=16)
    cu = torch.tensor([0, 1, 34, 35, 36], dtype=torch.int32)
    run = _cpp(_varlen(cpa.paged_attention_varlen), build)
    monkeypatch.setattr(cpa, "KERNEL_THREADS", 2)
    with torch_threads(1):
        one = run(torch.cat(qs), kc, vc, tables, cu, sl, 0.125)
    with torch_threads(2):
        assert torch.equal(one, run(torch.cat(qs), kc, vc, tables, cu, sl, 0.125)), \
            f"{fmt}: 1 and 2 threads disagree (shared scratch, or a dequantisation that depends on the item?)"


@pytest.mark.parametrize("bad, match", [
    (dict(k_scale=0.0), "k_scale must be a finite number > 0"),
    (dict(v_scale=float("nan")), "v_scale must be a finite number > 0"),
])
def test_bad_scales_are_refused(bad, match):
    kc, vc, tables, sl, _, _, qs = _paged_case("e4m3", (9,), (1,), seed=6)
    args = dict(k_scale=K_SCALE, v_scale=V_SCALE) | bad
    with pytest.raises(ValueError, match=match):
        ref.paged_attention_decode(qs[0], kc, vc, tables, sl, 0.25, **args)
    with pytest.raises(ValueError, match=match):
        triton_reshape_and_cache(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), kc, vc, torch.tensor([0]), **args)


def test_scale_on_an_unquantized_cache_is_refused():
    kc = torch.zeros(2, BLOCK, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="k_scale must be 1.0 for a float32 KV cache"):
        ref.reshape_and_cache(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), kc, kc.clone(), torch.tensor([0]),
                              k_scale=0.5)
