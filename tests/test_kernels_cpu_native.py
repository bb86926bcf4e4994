"""The C++ paged-attention kernel (`kernels/csrc/cpu_attn.cpp`, fp32 and bf16 caches) against
the dense oracle, Chapter 1's reference and the numba kernel it replaces, once per build
this CPU runs (the `native_isa` fixture: AVX-512 with BF16 and AVX2 + FMA on an AVX-512
machine, AVX2 + FMA on one without), and forced one at a time (the dispatch itself:
test_kernels_cpu_dispatch.py).

Same method as test_kernels_cpu_attention.py: the tests build the paged cache
themselves and fill every other slot with NaN, so a read past seq_len, of an
unused block or of a -1 table entry shows as NaN. The cases run at head_dim 32,
64 and 128 (the kernel's bf16 dot step takes 32 bf16 of a row at a time; Qwen3's
attention is 16 query / 8 KV heads of 128), in fp32 and bf16. Both builds are held to
the same oracles and tolerances. On a CPU with neither instruction set the tests that
need the kernel are skipped, and those about the fallback still run. Its fp8 caches are
tested beside the other fp8 paths, against the fp8 oracle: test_kernels_fp8_kv.py.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mini_vllm import paged_attention as ref
from mini_vllm.kernels import cpu_native, cpu_paged_attention as cpa
from kernel_cases import build_cache, native_isa, scrambled_layout, torch_threads  # noqa: F401 (a fixture)
from oracles import dense_causal_attention
from strategies import GQAShape, RaggedBatch, block_layouts, block_sizes, ragged_batches

REASON = cpu_native.unavailable_reason()
needs_native = pytest.mark.usefixtures("native_isa")  # once per build this CPU runs, that build forced
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # as the numba kernel's tests: bf16 is a few roundings of 2**-8
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


def run(batch, layout, shape, seed=0, scale=None, values=None, dtype=torch.bfloat16):
    """The kernel on one batch; returns (out, the inputs) after checking out against the
    dense float64 oracle per sequence and against Chapter 1's reference."""
    key_cache, value_cache, tables, seq_lens, ks, vs, qs = build_cache(batch, layout, shape, dtype, seed, values)
    scale = scale or shape.head_dim ** -0.5
    cu = torch.tensor(batch.cu_seqlens_q, dtype=torch.int32)
    query = torch.cat(qs)
    out = cpa.paged_attention_varlen(query, key_cache, value_cache, tables, cu, seq_lens, scale)
    assert out.dtype == dtype and out.shape == query.shape, "output must have query's shape and dtype"
    assert not torch.isnan(out).any(), "NaN in output: a slot past seq_len, an unused block or a -1 entry was read"
    oracle = torch.cat([dense_causal_attention(qs[i], ks[i], vs[i], scale) for i in range(batch.num_seqs)]).float()
    for i in range(batch.num_seqs):
        err = (out[cu[i]:cu[i + 1]].float() - oracle[cu[i]:cu[i + 1]]).abs().max().item()
        assert err <= TOL[dtype], (f"{dtype} seq {i} (seq_len {batch.seq_lens[i]}, q_len {batch.q_lens[i]}, block "
                            f"{layout.block_size}, heads {shape.num_heads}/{shape.num_kv_heads}, d {shape.head_dim}): "
                            f"error {err:.3g} (causal offset, GQA head map, block lookup or rescale?)")
    # The reference is fp32 too, with errors of its own: the kernel must be within TOL of it
    # plus the reference's own distance from the float64 oracle (large scores at scale 1).
    expected = ref.paged_attention_varlen(query, key_cache, value_cache, tables, cu, seq_lens, scale).float()
    ref_err = (expected - oracle).abs().max().item()
    assert (out.float() - expected).abs().max().item() <= TOL[dtype] + ref_err, "C++ kernel vs Chapter 1's reference"
    return out, (query, key_cache, value_cache, tables, cu, seq_lens, scale)


@pytest.fixture
def calls(monkeypatch):
    """The number of calls that reached the C++ kernel."""
    seen = []
    real = cpu_native.run
    monkeypatch.setattr(cpu_native, "run", lambda *a, **k: seen.append(1) or real(*a, **k))
    return seen


# The tests that compare with the numba kernel come after those that need only torch: in a
# fresh copy (a mutant's) numba compiles its kernel for each cache width first (10-20 s each).


@needs_native
def test_fp32_and_bf16_calls_take_the_cpp_kernel(calls):
    batch = RaggedBatch(seq_lens=(40, 7), q_lens=(1, 7))
    layout = scrambled_layout(batch.seq_lens, 16, seed=1)
    run(batch, layout, GQAShape(4, 2, 32), dtype=torch.bfloat16)
    run(batch, layout, GQAShape(4, 2, 16), dtype=torch.float32)
    assert len(calls) == 2, "bf16 with head_dim 32 and fp32 with head_dim 16 must run the C++ kernel"


@needs_native
def test_output_rounds_to_nearest_even_as_torch_does():
    """Chapter 1's reference computes in fp32 and torch rounds it to bf16 (nearest even).
    The C++ kernel rounds its own fp32 accumulator: both sum the same products in fp32 (in
    another order), so nearly every output has the same bits. A kernel that cut the fp32
    value to bf16 (toward zero) would differ in about half of them."""
    lens = tuple(range(40, 200, 10))
    batch = RaggedBatch(seq_lens=lens, q_lens=tuple(n if i % 4 == 0 else 1 for i, n in enumerate(lens)))
    out, args = run(batch, scrambled_layout(batch.seq_lens, 32, seed=6), GQAShape(16, 8, 128), seed=6)
    same = (out.view(torch.int16) == ref.paged_attention_varlen(*args).view(torch.int16)).float().mean().item()
    assert same >= 0.95, f"only {same:.1%} of outputs have the reference's bits: not rounded to nearest even?"


# A decode, a whole prefill (not a multiple of any block size) and a chunk after 29
# earlier positions, as the numba kernel's MIXED batch.
MIXED = RaggedBatch(seq_lens=(13, 37, 40), q_lens=(1, 37, 11))


@needs_native
@DTYPES
@pytest.mark.parametrize("head_dim", (32, 64, 128))
@pytest.mark.parametrize("block_size", (8, 16, 32))
@pytest.mark.parametrize("ratio", (1, 2, 4, 8, 16))
def test_every_gqa_ratio_block_size_and_head_dim(ratio, block_size, head_dim, dtype, calls):
    run(MIXED, scrambled_layout(MIXED.seq_lens, block_size, seed=ratio + block_size), GQAShape(2 * ratio, 2, head_dim),
        seed=ratio, dtype=dtype)
    assert calls, "the case did not reach the C++ kernel"


@needs_native
@DTYPES
@pytest.mark.parametrize("ratio", (1, 2, 4, 8, 16))
def test_decodes_around_block_boundaries(ratio, dtype):
    """Context lengths of one token, a block but one, one block (where the prefetch of the
    next block must stop), one past, two blocks and one past, and a longer one; 16 query
    heads per KV head take the tiled items (DECODE_MAX_GROUP)."""
    for block_size in (16, 32):
        lens = (1, block_size - 1, block_size, block_size + 1, 2 * block_size, 2 * block_size + 1, 3 * block_size + 5)
        batch = RaggedBatch(seq_lens=lens, q_lens=(1,) * len(lens))
        layout = scrambled_layout(lens, block_size, seed=ratio)
        out, args = run(batch, layout, GQAShape(2 * ratio, 2, 64), seed=ratio, dtype=dtype)
        query, k, v, tables, _, seq_lens, scale = args
        assert torch.equal(cpa.paged_attention_decode(query, k, v, tables, seq_lens, scale), out), \
            "paged_attention_decode and paged_attention_varlen differ on a decode batch"


@needs_native
@DTYPES
@pytest.mark.parametrize("q_lens", [(1, 1, 1), (70, 33, 8)], ids=["decodes", "prefills"])
def test_the_running_max_rises_at_every_block(q_lens, dtype):
    """Positive q and k growing with the position: each block's scores exceed the last
    block's, so every step must rescale what the earlier blocks accumulated (a kernel that
    skipped it would weigh early keys several times too much). Scale 0.25: at scale 1 the
    70-token prefill's scores reach the hundreds, where fp32 sums of 32 products (the
    reference's too) drift more than 1e-5 from the float64 oracle."""
    g = torch.Generator().manual_seed(7)
    growing = lambda n, h: torch.rand(n, h, 32, generator=g) * torch.linspace(1, 3, n)[:, None, None]  # noqa: E731
    batch = RaggedBatch(seq_lens=(70, 33, 8), q_lens=q_lens)
    for ratio in (1, 2, 8):
        run(batch, scrambled_layout(batch.seq_lens, 8, seed=ratio), GQAShape(2 * ratio, 2, 32), seed=ratio,
            scale=0.25, values=growing, dtype=dtype)


@needs_native
def test_large_logits_need_the_running_max():
    """Scores in the hundreds: exp without subtracting the running max overflows to inf."""
    big = lambda n, h: torch.randn(n, h, 32, generator=torch.Generator().manual_seed(n)) * 12  # noqa: E731
    batch = RaggedBatch(seq_lens=(50, 20), q_lens=(1, 20))
    run(batch, scrambled_layout(batch.seq_lens, 16, seed=2), GQAShape(4, 2, 32), scale=1.0, values=big)


@needs_native
@DTYPES
def test_one_and_two_threads_give_identical_bits(monkeypatch, dtype):
    """Each item is one thread's, in a fixed order, and a row's arithmetic does not depend
    on its item: two threads (and decodes split into runs of KV heads) give one thread's bits."""
    lens = [(60 + 37 * i) % 300 + 1 for i in range(24)]
    batch = RaggedBatch(seq_lens=tuple(lens), q_lens=tuple(s if i % 6 == 0 else 1 for i, s in enumerate(lens)))
    monkeypatch.setattr(cpa, "KERNEL_THREADS", 2)
    with torch_threads(1):
        one, args = run(batch, scrambled_layout(batch.seq_lens, 16, seed=3), GQAShape(16, 8, 128), seed=3,
                        dtype=dtype)
    with torch_threads(2):
        for _ in range(3):
            assert torch.equal(one, cpa.paged_attention_varlen(*args)), "1 and 2 threads disagree (shared scratch?)"
    # 3 decodes on 2 threads: each split into items of KV heads. Of 4 KV heads, two items of 2
    # (decode_block_major); of 2, one per head (attend_item's head-by-head loop). One thread
    # takes all the heads in one item (decode_block_major): both paths must give its bits.
    few = RaggedBatch(seq_lens=(300, 77, 32), q_lens=(1, 1, 1))
    for shape in (GQAShape(8, 4, 64), GQAShape(4, 2, 64)):
        with torch_threads(1):
            one, args = run(few, scrambled_layout(few.seq_lens, 16, seed=4), shape, seed=4, dtype=dtype)
        with torch_threads(2):
            assert torch.equal(one, cpa.paged_attention_varlen(*args)), \
                f"decode items split into runs of KV heads change the bits ({shape})"


@needs_native
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_ragged_batches_against_the_numba_kernel(data):
    """Random ragged batches and block layouts: the C++ kernel against the oracle, and
    within bf16 rounding of the numba kernel on the same inputs."""
    batch = data.draw(ragged_batches(max_seqs=5, max_seq_len=90))
    layout = data.draw(block_layouts(batch.seq_lens, data.draw(block_sizes())))
    ratio = data.draw(st.sampled_from((1, 2, 4)))
    dtype = data.draw(st.sampled_from((torch.float32, torch.bfloat16)))
    out, args = run(batch, layout, GQAShape(2 * ratio, 2, data.draw(st.sampled_from((32, 64)))),
                    seed=data.draw(st.integers(0, 2**16)), dtype=dtype)
    numba_out = _numba_only(args)
    assert (out.float() - numba_out.float()).abs().max().item() <= TOL[dtype], "C++ and numba kernels disagree"


def _numba_only(args):
    with cpu_native.numba_only():
        return cpa.paged_attention_varlen(*args)


@needs_native
def test_fp16_and_head_dims_it_cannot_split_stay_on_numba(calls):
    batch = RaggedBatch(seq_lens=(40, 7), q_lens=(1, 7))
    layout = scrambled_layout(batch.seq_lens, 16, seed=1)
    for dtype, head_dim in ((torch.float16, 32), (torch.bfloat16, 16), (torch.float32, 8)):
        k, v, tables, seq_lens, _, _, qs = build_cache(batch, layout, GQAShape(4, 2, head_dim), dtype, 0)
        cpa.paged_attention_varlen(torch.cat(qs), k, v, tables, torch.tensor(batch.cu_seqlens_q, dtype=torch.int32),
                                   seq_lens, 0.25)
    assert not calls, "fp16 caches and head_dims the C++ kernel cannot split must stay on the numba kernel"


def test_a_failed_build_falls_back_to_numba_with_a_warning(monkeypatch, caplog, calls):
    """A compiler that fails: one warning naming the failure, and the numba kernel's result."""
    if REASON is not None and "compiler" not in REASON:
        pytest.skip(f"the C++ kernel cannot run here anyway: {REASON}")
    monkeypatch.setenv("CXX", "false")  # exits 1 without writing anything
    monkeypatch.setattr(cpu_native, "_state", {})
    batch = RaggedBatch(seq_lens=(20,), q_lens=(20,))
    with caplog.at_level("WARNING", logger="mini_vllm"):
        run(batch, scrambled_layout(batch.seq_lens, 8, seed=0), GQAShape(4, 2, 32))
        run(batch, scrambled_layout(batch.seq_lens, 8, seed=0), GQAShape(4, 2, 32))
    warnings = [r for r in caplog.records if "C++ attention kernel is unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "false" in warnings[0].getMessage(), \
        "a failed build must be reported once, naming the command that failed"
    assert cpu_native.library() is None and not calls, "after a failed build every call must run the numba kernel"


@pytest.mark.parametrize("build", list(cpu_native.ISAS))
def test_each_build_is_forced_by_use_isa_or_refused(build, calls):
    """use_isa(build) runs that build where this CPU can (its library's symbols carry its
    name, so both load in one process), and the numba kernel where it cannot."""
    batch = RaggedBatch(seq_lens=(40, 7), q_lens=(1, 7))
    runs = cpu_native.unavailable_reason(build) is None
    with cpu_native.use_isa(build):
        out, args = run(batch, scrambled_layout(batch.seq_lens, 16, seed=1), GQAShape(4, 2, 32))
        lib = cpu_native.library()
    if not runs:
        assert lib is None and not calls, f"the {build} build ran on a CPU without it"
        return
    assert lib is not None and lib.worker.__name__ == f"mini_vllm_attn_worker_{build}" and calls, \
        f"use_isa({build!r}) did not run the {build} build"
    assert (out.float() - _numba_only(args).float()).abs().max().item() <= TOL[torch.bfloat16]
