"""The numba CPU paged-attention kernel against the dense oracle and Chapter 1's reference.

As for the Triton kernels: the tests build the paged cache themselves (plain
indexing, never the code under test) and fill every other slot with NaN, so
a kernel that reads a slot past seq_len, an unused block or a -1 table entry
returns NaN. Oracles: `dense_causal_attention` on contiguous K/V in float64,
and the reference `mini_vllm.paged_attention`, which the engine's other
backends are checked against too.

fp32 cases come first in the file: a planted mistake fails there before the
16-bit variant of the kernel is compiled (seconds under `make mutants`).
"""
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import numba  # after torch, as the engine imports them
from hypothesis import given, strategies as st

from mini_vllm import paged_attention as ref
from mini_vllm.attention.backends import get_attn_backend
from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.kernels import cpu_native, cpu_paged_attention as cpa
from mini_vllm.kernels.cpu_paged_attention import paged_attention_decode, paged_attention_varlen
from kernel_cases import BAD, BAD_VARLEN, build_cache, good_args, raised_message, scrambled_layout, torch_threads
from oracles import dense_causal_attention
from strategies import GQAShape, RaggedBatch, block_layouts, block_sizes, gqa_shapes, ragged_batches

TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True, scope="module")
def numba_kernel_only():
    """This file tests the numba kernel: where the C++ kernel would take fp32 and bf16
    calls (kernels/cpu_native.py, tested in test_kernels_cpu_native.py), it is switched
    off here, so every case runs the numba loops on every CPU."""
    with cpu_native.numba_only():
        yield


def assert_close(out, expected, dtype, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in output -> a slot past seq_len, an unused block or a -1 entry was read"
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= TOL[dtype], (f"{what}: max abs error {err:.3g} > {TOL[dtype]} in {dtype} "
                               "(wrong causal offset, GQA head map, block lookup or softmax rescale?)")


def check_varlen(batch, layout, shape, dtype, seed=0, scale=None, values=None):
    key_cache, value_cache, tables, seq_lens, ks, vs, qs = build_cache(batch, layout, shape, dtype, seed, values)
    scale = scale or shape.head_dim ** -0.5
    cu = torch.tensor(batch.cu_seqlens_q, dtype=torch.int32)
    query = torch.cat(qs)
    out = paged_attention_varlen(query, key_cache, value_cache, tables, cu, seq_lens, scale)
    assert out.shape == query.shape and out.dtype == dtype, "output must have query's shape and dtype"
    for i in range(batch.num_seqs):
        what = (f"seq {i} (seq_len {batch.seq_lens[i]}, q_len {batch.q_lens[i]}, block {layout.block_size}, "
                f"heads {shape.num_heads}/{shape.num_kv_heads}, {dtype})")
        assert_close(out[cu[i]:cu[i + 1]], dense_causal_attention(qs[i], ks[i], vs[i], scale), dtype, what)
    expected = ref.paged_attention_varlen(query, key_cache, value_cache, tables, cu, seq_lens, scale)
    assert_close(out, expected, dtype, "cpu kernel vs Chapter 1's reference")
    return out


# Every GQA ratio x block size, on one batch mixing a decode, a whole prefill
# (not a multiple of any block size) and a chunk after 29 earlier positions.
MIXED = RaggedBatch(seq_lens=(13, 37, 40), q_lens=(1, 37, 11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", (8, 16, 32))
@pytest.mark.parametrize("ratio", (1, 2, 4))
def test_every_gqa_ratio_and_block_size(ratio, block_size, dtype):
    check_varlen(MIXED, scrambled_layout(MIXED.seq_lens, block_size, seed=ratio * block_size),
                 GQAShape(2 * ratio, 2, 16), dtype, seed=ratio)


# Decode batches (every q_len 1) take the kernel's decode path (plain loops,
# all KV heads of a sequence in one item, prefetches one block ahead) up to
# DECODE_MAX_GROUP query heads per KV head, and the tiled path beyond (GQA 16
# here). Context lengths sit around block boundaries: one token, a block but
# one, exactly one block (the prefetch one block ahead must stop there), one
# token past it, two blocks and one past, and a longer one.
def decode_lens(block_size):
    return (1, block_size - 1, block_size, block_size + 1, 2 * block_size, 2 * block_size + 1, 3 * block_size + 5)


def check_decode(ratio, block_size, dtype, seed, head_dim=16):
    """Both entry points on one decode batch, against the dense oracle and the reference."""
    lens = decode_lens(block_size)
    batch = RaggedBatch(seq_lens=lens, q_lens=(1,) * len(lens))
    layout = scrambled_layout(lens, block_size, seed=seed)
    shape = GQAShape(2 * ratio, 2, head_dim)
    out = check_varlen(batch, layout, shape, dtype, seed=seed)
    key_cache, value_cache, tables, seq_lens, _, _, qs = build_cache(batch, layout, shape, dtype, seed)
    decode = paged_attention_decode(torch.cat(qs), key_cache, value_cache, tables, seq_lens, head_dim ** -0.5)
    assert torch.equal(decode, out), "paged_attention_decode and paged_attention_varlen differ on a decode batch"


@pytest.mark.parametrize("ratio", (1, 2, 4, 8, 16))
def test_decode_batches_every_gqa_ratio_and_block_size(ratio):
    for block_size in (8, 16, 32):
        check_decode(ratio, block_size, torch.float32, seed=ratio * block_size)


def test_decode_rescales_at_every_step(monkeypatch):
    """One cache block per softmax step and positive q and k that grow with the
    position: each step's scores are larger than the last, so the running max
    rises at every step and the accumulator and sum must be rescaled each time
    (a decode path that skipped it would weigh early keys up to e^8 too much)."""
    monkeypatch.setattr(cpa, "KV_TILE_BYTES", 1)  # rounds up to one block per step
    g = torch.Generator().manual_seed(7)
    growing = lambda n, h: torch.rand(n, h, 16, generator=g) * torch.linspace(1, 3, n)[:, None, None]  # noqa: E731
    batch = RaggedBatch(seq_lens=(70, 33, 8), q_lens=(1, 1, 1))
    for ratio in (1, 2, 4, 8):
        check_varlen(batch, scrambled_layout(batch.seq_lens, 8, seed=ratio), GQAShape(2 * ratio, 2, 16),
                     torch.float32, seed=ratio, scale=1.0, values=growing)


def test_decode_batch_mixed_with_prefills_and_chunks():
    """The engine's mixed steps: decodes (decode path) beside a prefill and a
    chunk (tiled path) in one launch, decodes at and one past block boundaries."""
    batch = RaggedBatch(seq_lens=(32, 64, 33, 50, 17, 1), q_lens=(1, 64, 1, 20, 1, 1))
    for ratio in (1, 2, 4, 8, 16):
        check_varlen(batch, scrambled_layout(batch.seq_lens, 16, seed=ratio), GQAShape(2 * ratio, 2, 32),
                     torch.float32, seed=ratio)


@given(ragged_batches(max_seqs=6, max_seq_len=80), st.sampled_from((1, 2, 4, 8, 16)), st.integers(1, 4),
       st.integers(1, 3), st.sampled_from((2, 8, 64)))
def test_plan_covers_every_query_row_once(batch, group, num_kv_heads, threads, tile_tokens):
    """Every (sequence, query token, KV head) is in exactly one work item, for
    decode items of all KV heads, decode items split into runs of KV heads (few
    decodes, several threads), tiled decodes (group above DECODE_MAX_GROUP) and
    prefill tiles; items come longest first."""
    cu = np.array(batch.cu_seqlens_q, dtype=np.int32)
    seq_lens = np.array(batch.seq_lens, dtype=np.int32)
    item_seq, item_t0, item_h0, decode_heads = cpa.plan_items(cu, seq_lens, tile_tokens, num_kv_heads, group, threads)
    decodes = sum(q == 1 for q in batch.q_lens)
    if group > cpa.DECODE_MAX_GROUP:
        want_heads = 0
    elif threads == 1 or decodes >= cpa.DECODE_ITEMS_PER_THREAD * threads:
        want_heads = num_kv_heads
    else:  # few decodes: split into about one item per thread, of whole KV heads
        want_heads = max(d for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0 and d <= max(1, num_kv_heads // threads))
    assert decode_heads == want_heads, f"a decode item covers {decode_heads} KV heads, expected {want_heads}"
    covered, costs = [], []
    for i, t0, h0 in zip(item_seq, item_t0, item_h0):
        q_len, seq_len = batch.q_lens[i], batch.seq_lens[i]
        if q_len == 1 and decode_heads:
            covered += [(i, 0, h) for h in range(h0, h0 + decode_heads)]
            costs.append(decode_heads * seq_len)  # query rows (over group) x keys
        else:
            t1 = min(t0 + tile_tokens, q_len)
            covered += [(i, t, h0) for t in range(t0, t1)]
            costs.append((t1 - t0) * (seq_len - q_len + t1))
    expected = [(i, t, h) for i, q in enumerate(batch.q_lens) for t in range(q) for h in range(num_kv_heads)]
    assert sorted(covered) == expected, "work items miss or repeat a (sequence, query token, KV head)"
    assert costs == sorted(costs, reverse=True), "work items must come longest first"


def test_large_logits_need_the_running_max():
    """Scores of several hundred: exp overflows fp32 unless each block's scores
    are taken relative to the running max. Integer q, k and a power-of-two
    scale make every score exact, so the tight bound still holds."""
    batch, shape = RaggedBatch(seq_lens=(45, 30), q_lens=(1, 30)), GQAShape(4, 2, 16)
    layout = scrambled_layout(batch.seq_lens, 8, seed=5)
    ints = lambda n, h: torch.randint(-8, 9, (n, h, 16), generator=torch.Generator().manual_seed(n * h)).float()  # noqa: E731
    key_cache, value_cache, tables, seq_lens, ks, _, qs = build_cache(batch, layout, shape, torch.float32, 5, ints)
    top = max((torch.einsum("qhd,khd->qhk", q, k.repeat_interleave(2, dim=1)) * 4.0).max().item()
              for q, k in zip(qs, ks))
    assert top > 100, f"the largest score is {top}: too small to overflow exp without the running max"
    out = paged_attention_varlen(torch.cat(qs), key_cache, value_cache, tables,
                                 torch.tensor(batch.cu_seqlens_q, dtype=torch.int32), seq_lens, 4.0)
    assert out.isfinite().all(), "softmax overflowed: scores were exponentiated without the running max"
    check_varlen(batch, layout, shape, torch.float32, seed=5, scale=4.0, values=ints)


def test_long_prefill_spans_many_query_tiles(monkeypatch):
    """8-row tiles and one cache block per softmax step: a 40-token prefill is
    10 to 40 work items per KV head and 5 steps, so the per-tile causal bound,
    the tile -> token map and the rescale between steps are exercised."""
    monkeypatch.setattr(cpa, "TILE_ROWS", 8)
    monkeypatch.setattr(cpa, "KV_TILE_BYTES", 1)  # rounds up to one block per step
    batch = RaggedBatch(seq_lens=(3, 40, 33, 17), q_lens=(3, 40, 18, 1))
    for ratio in (1, 4):
        check_varlen(batch, scrambled_layout(batch.seq_lens, 8, seed=ratio), GQAShape(2 * ratio, 2, 32),
                     torch.float32, seed=ratio)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", (1, 2, 4))
def test_prefills_at_the_default_tile_sizes(ratio, dtype):
    """The sizes the engine runs: full 64-row query tiles and several
    128-key softmax steps (head_dim 64) per item, with a whole prefill, a chunk
    after 200 earlier positions, a decode and a 21-token prefill (a partial tile)."""
    batch = RaggedBatch(seq_lens=(300, 300, 290, 21), q_lens=(300, 100, 1, 21))
    check_varlen(batch, scrambled_layout(batch.seq_lens, 16, seed=ratio), GQAShape(2 * ratio, 2, 64), dtype,
                 seed=ratio)


def test_one_and_two_threads_give_identical_bits(monkeypatch):
    """Each work item is computed by one thread in a fixed order, so the thread
    count changes nothing; a race on the per-thread scratch would. Enough
    items (24 sequences x 2 KV heads, hundreds of keys each) that both
    threads run at once."""
    lens = [(60 + 37 * i) % 300 + 1 for i in range(24)]
    batch = RaggedBatch(seq_lens=tuple(lens), q_lens=tuple(s if i % 6 == 0 else 1 for i, s in enumerate(lens)))
    layout = scrambled_layout(batch.seq_lens, 16, seed=3)
    shape = GQAShape(8, 2, 64)
    key_cache, value_cache, tables, seq_lens, _, _, qs = build_cache(batch, layout, shape, torch.float32, 3)
    args = (torch.cat(qs), key_cache, value_cache, tables, torch.tensor(batch.cu_seqlens_q, dtype=torch.int32),
            seq_lens, 0.125)
    monkeypatch.setattr(cpa, "KERNEL_THREADS", 2)  # at most 2, whatever the machine has
    with torch_threads(1):
        one = paged_attention_varlen(*args)
    with torch_threads(2):
        for _ in range(3):
            assert torch.equal(one, paged_attention_varlen(*args)), \
                "1 and 2 threads disagree: threads share scratch or split an item"
    assert_close(one, ref.paged_attention_varlen(*args), torch.float32, "cpu kernel vs reference, 24 sequences")


def test_plan_cache_is_built_once_per_batch_and_changes_nothing(monkeypatch):
    """The engine passes one plan cache per step, shared by its layers: the
    first call plans, the others reuse the plan; the output is the same bits
    as without the cache. A cache keyed without the thread count would hand a
    1-thread plan (all KV heads per decode item) to a 2-thread call."""
    lens = [(40 + 29 * i) % 200 + 1 for i in range(12)]
    batch = RaggedBatch(seq_lens=tuple(lens), q_lens=tuple(s if i % 5 == 0 else 1 for i, s in enumerate(lens)))
    shape = GQAShape(4, 2, 32)
    key_cache, value_cache, tables, seq_lens, _, _, qs = build_cache(
        batch, scrambled_layout(batch.seq_lens, 16, seed=5), shape, torch.float32, 5)
    args = (torch.cat(qs), key_cache, value_cache, tables, torch.tensor(batch.cu_seqlens_q, dtype=torch.int32),
            seq_lens, 0.125)
    plain = cpa.run_varlen(*args)
    calls = []
    real = cpa.plan_items
    monkeypatch.setattr(cpa, "plan_items", lambda *a: calls.append(a[-1]) or real(*a))
    cache = {}
    for _ in range(3):
        assert torch.equal(cpa.run_varlen(*args, plan_cache=cache), plain), "a cached plan changed the output"
    assert len(calls) == 1, f"the plan must be built once per batch, was built {len(calls)} times"
    monkeypatch.setattr(cpa, "KERNEL_THREADS", 2)
    with torch_threads(2):
        assert torch.equal(cpa.run_varlen(*args, plan_cache=cache), plain), "2 threads with a cached plan"
    expected = 2 if numba.config.NUMBA_NUM_THREADS >= 2 else 1  # a new thread count, a new plan
    assert len(calls) == expected, "a plan made for one thread count was reused for another (it splits work per thread)"


def test_few_decodes_split_per_kv_head_give_identical_bits(monkeypatch):
    """With 2 threads and fewer than DECODE_ITEMS_PER_THREAD decodes per
    thread, each decode becomes two items of half its KV heads, so both threads
    get work; a query row's arithmetic does not depend on the split, so the
    bits match one thread's (all KV heads in one item)."""
    batch = RaggedBatch(seq_lens=(300, 77, 32), q_lens=(1, 1, 1))
    layout = scrambled_layout(batch.seq_lens, 16, seed=4)
    shape = GQAShape(8, 4, 64)
    key_cache, value_cache, tables, seq_lens, ks, vs, qs = build_cache(batch, layout, shape, torch.float32, 4)
    args = (torch.cat(qs), key_cache, value_cache, tables, seq_lens, 0.125)
    cu = np.array(batch.cu_seqlens_q, dtype=np.int32)
    assert cpa.plan_items(cu, seq_lens.numpy(), 16, 4, 2, threads=2)[3] == 2, "3 decodes on 2 threads: split in two"
    assert cpa.plan_items(cu, seq_lens.numpy(), 16, 4, 2, threads=1)[3] == 4, "1 thread: all KV heads per item"
    monkeypatch.setattr(cpa, "KERNEL_THREADS", 2)  # at most 2, whatever the machine has
    with torch_threads(1):
        one = paged_attention_decode(*args)
    with torch_threads(2):
        assert torch.equal(one, paged_attention_decode(*args)), "decode items split per KV head change the bits"
    for i in range(batch.num_seqs):
        assert_close(one[i:i + 1], dense_causal_attention(qs[i], ks[i], vs[i], 0.125), torch.float32, f"decode {i}")


# The fresh-process tests below: each starts numba's pool once, in a new interpreter,
# running one case of tests/programs/numba_threads.py.
PROGRAMS = Path(__file__).resolve().parent / "programs"


def run_fresh(case: list[str], failure: str, **env: str) -> list[str]:
    """Run numba_threads.py's `case` (its name, then its argument if any) in a fresh
    interpreter, with this process's OMP_NUM_THREADS and NUMBA_NUM_THREADS removed
    and `env` added; returns the words it printed. `failure` names the bug a
    non-zero exit means."""
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    full.update(env)
    out = subprocess.run([sys.executable, str(PROGRAMS / "numba_threads.py"), *case], capture_output=True,
                         text=True, env=full, timeout=300)
    assert out.returncode == 0, f"{failure}:\n" + out.stderr[-2000:]
    return out.stdout.split()


def test_the_kernel_keeps_torchs_thread_count():
    """Where numba's OpenMP layer shares torch's libgomp, its start-up sets the
    process-wide OpenMP thread count to every core. In a fresh process (the
    start-up happens once), torch must still use the 1 thread it was set to."""
    # NUMBA_NUM_THREADS=2: as on any machine with 2 or more cores, pinned or not
    seen = run_fresh(["torch-threads-kept"], "the kernel failed in a fresh process", NUMBA_NUM_THREADS="2")
    assert seen[-1] == "1", (f"after the kernel's first call torch uses {seen[-1]} threads, "
                             "not the 1 it was set to: numba's OpenMP start-up overrode torch's setting")


def test_importing_the_kernels_keeps_omp_num_threads():
    """A process started with OMP_NUM_THREADS=1 (as `bench_serving.py` starts the
    server) and no set_num_threads call: importing the layer ops starts numba's
    pool, which set the importing thread's OpenMP count to every core, and every
    later torch op (the linears) ran on all cores, 2 threads on 1 pinned core in
    the server. torch must still use 1 thread after the import, a layer op and
    a kernel call."""
    seen = run_fresh(["omp-threads-kept"], "the layer ops or the kernel failed in a fresh process",
                     OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="2")
    assert seen == ["1", "1", "1"], (
        f"torch's thread counts after import / layer op / kernel call: {seen}, not 1 as "
        "OMP_NUM_THREADS says: numba's pool start-up overrode it")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs to widen the affinity")
def test_a_kernel_imported_on_one_core_uses_two_threads_later():
    """numba fixes its pool size at import. A process pinned to one core when it
    first imports the kernel, then widened to two (as the benchmarks do between
    their 1- and 2-thread phases), must run the kernel on two threads."""
    seen = run_fresh(["widened-after-import"], "the kernel failed after its process was widened to 2 cores")
    assert seen[-1] == "2", (f"the kernel ran on {seen[-1]} thread(s) with torch at 2: "
                             "numba's pool kept the size of the affinity it was imported under")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs to pin to one of them")
@pytest.mark.parametrize("first", ["numba", "mini_vllm.kernels.cpu_layer_ops"])
def test_numba_imported_before_the_kernel_on_one_core(first):
    """numba read its configuration (a pool of 1 on one core) before the
    kernel modules size the pool. When the size went through the environment,
    numba re-read it on a later compile and refused the changed size: the first
    parallel layer op (a pinned server's first request) raised instead of
    running. Set on numba's config before the pool starts, it must hold, and
    the pool must get every CPU, whoever imported numba first."""
    seen = run_fresh(["imported-on-one-core", first], "a parallel op failed after numba was imported on one core")
    assert int(seen[-1]) >= 2, "numba's pool kept the size of the affinity it was imported under"


def test_importing_the_kernels_changes_no_environment_and_starts_no_thread():
    """Importing a kernel module used to set NUMBA_NUM_THREADS (inherited by
    every child process) and start numba's thread pool; now the settings go on
    numba's config and the pool starts on the first kernel call."""
    seen = run_fresh(["import-side-effects"], "importing the kernel modules failed in a fresh process")
    assert seen[0] == "env-changed:none", f"importing the kernels changed the environment: {seen[0]}"
    assert seen[1] == "pool-started:False", "importing the kernels started numba's thread pool"


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="builds for an x86 model (Haswell): only an x86 machine can run that code")
def test_the_kernels_build_and_agree_on_a_cpu_without_avx512(tmp_path):
    """Every compiled loop, built for Haswell (AVX2 + FMA, the feature set of an
    x86 laptop without AVX-512) with torch, oneDNN, MKL and OpenBLAS held to AVX2
    too (`AVX2_ONLY_ENV`): the attention kernel (fp32 / bf16 / fp16 caches, decode,
    tiled and mixed batches) and the fused layer ops agree with torch, their
    loops are vectorized with 256-bit registers, and no AVX-512 instruction is in
    their machine code (on this machine's native build the scan finds thousands).
    The C++ kernels run there in their AVX2 build, never the AVX-512 one, and agree
    with torch as closely."""
    from mini_vllm.kernels.cpu_runtime import AVX2_ONLY_ENV

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    env.update(AVX2_ONLY_ENV, NUMBA_CACHE_DIR=str(tmp_path))  # empty: machine code is inspectable only when built here
    proc = subprocess.run([sys.executable, str(PROGRAMS / "avx2_kernels.py")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, "the kernels failed when built for an AVX2-only CPU:\n" + proc.stderr[-2000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["cpu"] == "haswell" and "avx512" not in report["features"], (
        f"numba did not target an AVX2-only CPU: {report['cpu']} {report['features'][:200]}")
    for case, err in report["errors"].items():
        tol = 1e-5 if case.endswith("float32") else 2e-2  # bf16 / fp16: a few roundings of 2**-8
        assert err <= tol, f"{case}: differs from torch by {err:.3g} when built for AVX2 (a loop that assumes AVX-512?)"
    assert not report["not_compiled"], f"these loops were never compiled by the cases: {report['not_compiled']}"
    assert report["native_isa"] == "avx2", (
        f"numba held to Haswell must run the AVX2 C++ build, never the AVX-512 one: got {report['native_isa']!r}")
    if report["native"] is None:  # a compiler here (else the C++ cases ran numba again)
        assert report["native_loaded"], "the AVX2 C++ build did not load"
    for case, err in report["native_errors"].items():
        tol = 1e-5 if case.endswith("float32") else 2e-2
        assert err <= tol, f"{case}: the AVX2 C++ build differs from torch by {err:.3g}"
    for fn, seen in report["code"].items():
        assert seen["avx512"] == 0, f"{fn}: {seen['avx512']} AVX-512 instructions in a build for an AVX2-only CPU"
        assert seen["ymm"] > 0, f"{fn}: no 256-bit register used: its loops did not vectorize for AVX2"


@st.composite
def cases(draw, dtypes, decode_only=False):
    batch = draw(ragged_batches(max_seqs=4, max_seq_len=56, decode_only=decode_only))
    layout = draw(block_layouts(batch.seq_lens, draw(block_sizes())))
    return batch, layout, draw(gqa_shapes(ratios=(1, 2, 4))), draw(st.sampled_from(dtypes))


@given(cases((torch.float32, torch.bfloat16, torch.float16)), st.integers(0, 2**16))
def test_ragged_batches(case, seed):
    check_varlen(*case, seed=seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ratio", (1, 2, 4, 8, 16))
def test_16_bit_decode_batches(ratio, dtype):
    """As test_decode_batches_every_gqa_ratio_and_block_size, in bf16 (widened
    in the decode loops) and fp16 (widened a row at a time)."""
    for block_size in (8, 16, 32):
        check_decode(ratio, block_size, dtype, seed=ratio * block_size)


@given(cases((torch.float32, torch.bfloat16), decode_only=True))
def test_decode_entry_point(case):
    batch, layout, shape, dtype = case
    key_cache, value_cache, tables, seq_lens, ks, vs, qs = build_cache(batch, layout, shape, dtype, 0)
    scale = shape.head_dim ** -0.5
    out = paged_attention_decode(torch.cat(qs), key_cache, value_cache, tables, seq_lens, scale)
    for i in range(batch.num_seqs):
        assert_close(out[i:i + 1], dense_causal_attention(qs[i], ks[i], vs[i], scale), dtype,
                     f"decode seq {i} (seq_len {batch.seq_lens[i]})")


@given(st.data())
def test_backend_reads_blocks_another_sequence_writes_in_the_same_step(data):
    """Sequence A prefills; sequence B is a prefix-cache hit on A's first
    blocks, which A writes in this very step, and queries its own tail. The
    "cpu" backend must write the whole batch before reading any of it."""
    bs = data.draw(block_sizes())
    len_a = data.draw(st.integers(bs, 60))
    shared = data.draw(st.integers(1, len_a // bs))
    tail = data.draw(st.integers(1, 20))
    b_first = data.draw(st.booleans())
    dtype = data.draw(st.sampled_from((torch.float32, torch.bfloat16)))
    shape = data.draw(gqa_shapes(ratios=(1, 2, 4)))
    blocks_a, blocks_b = -(-len_a // bs), -(-tail // bs)
    ids = data.draw(st.permutations(range(blocks_a + blocks_b + 2)))
    row_a = list(ids[:blocks_a])
    row_b = row_a[:shared] + list(ids[blocks_a:blocks_a + blocks_b])
    seqs = [(len_a, len_a, row_a), (shared * bs + tail, tail, row_b)]
    if b_first:
        seqs.reverse()
    g = torch.Generator().manual_seed(len_a * 100 + tail)
    num_tokens = len_a + tail
    q = torch.randn(num_tokens, shape.num_heads, shape.head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, generator=g).to(dtype)
    cache_shape = (len(ids), bs, shape.num_kv_heads, shape.head_dim)
    kc, vc = torch.full(cache_shape, float("nan"), dtype=dtype), torch.full(cache_shape, float("nan"), dtype=dtype)
    width = max(len(r) for _, _, r in seqs) + 1
    slots = [r[p // bs] * bs + p % bs for s, n, r in seqs for p in range(s - n, s)]
    cu = [0, seqs[0][1], num_tokens]
    md = AttentionMetadata(torch.tensor(slots), torch.tensor([r + [-1] * (width - len(r)) for _, _, r in seqs],
                                                             dtype=torch.int32),
                           torch.tensor(cu, dtype=torch.int32), torch.tensor([s for s, _, _ in seqs], dtype=torch.int32),
                           max(n for _, n, _ in seqs), max(s for s, _, _ in seqs),
                           [n for _, n, _ in seqs], [s for s, _, _ in seqs])
    scale = shape.head_dim ** -0.5
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref.reshape_and_cache(k, v, ref_kc, ref_vc, md.slot_mapping)
    expected = ref.paged_attention_varlen(q, ref_kc, ref_vc, md.block_tables, md.cu_seqlens_q, md.seq_lens, scale)
    out = get_attn_backend("cpu").forward(q, k, v, kc, vc, md, scale)
    assert_close(out, expected, dtype, f"A {len_a} tokens, B hits {shared} shared blocks + {tail}, B first {b_first}")


@pytest.mark.parametrize("field,change,word", BAD + BAD_VARLEN)
def test_bad_input_matches_reference(field, change, word):
    args = {**good_args(), **change}
    msg = raised_message(paged_attention_varlen, **args)
    assert word in msg, f"error for bad {field} must name it: {msg!r}"
    assert msg == raised_message(ref.paged_attention_varlen, **args), "cpu kernel and reference must reject alike"


def test_strided_cache_is_rejected_not_copied():
    args = good_args()
    args["key_cache"] = torch.zeros(4, 2, 8, 16).transpose(1, 2)  # the shape of the cache, other strides
    with pytest.raises(ValueError, match="key_cache must be contiguous"):
        paged_attention_varlen(**args)
