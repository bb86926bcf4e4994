"""Chapter 1: slot mapping, reshape_and_cache, and the write-then-attend round trip."""
import math

import torch
from hypothesis import given, strategies as st

from oracles import dense_causal_attention
from strategies import block_layouts, block_sizes, gqa_shapes, ragged_batches


def hand_slot(block_table_row, pos, block_size):
    """Textbook translation: logical block pos // B -> physical block, plus offset."""
    return block_table_row[pos // block_size] * block_size + pos % block_size


def test_thesis_block_table_translation_example(chapter):
    """seed 001 Fig. 3.6: block size 4, a 7-token prompt in logical blocks 0, 1 ->
    physical 7, 1; decode step 1 fills the last slot of block 1; decode step 2
    needs a new block, physical 3."""
    pa = chapter("paged_attention")
    B = 4
    table = torch.tensor([[7, 1, -1]], dtype=torch.int32)
    prompt = pa.compute_slot_mapping(table, torch.zeros(7, dtype=torch.int32), torch.arange(7, dtype=torch.int32), B)
    assert prompt.tolist() == [28, 29, 30, 31, 4, 5, 6], "prompt tokens 0-3 belong in block 7, tokens 4-6 in block 1"
    assert prompt.dtype == torch.int64, "slot_mapping must be int64"
    step1 = pa.compute_slot_mapping(table, torch.tensor([0], dtype=torch.int32), torch.tensor([7], dtype=torch.int32), B)
    assert step1.tolist() == [7], "the first decoded token fills the reserved slot 3 of physical block 1"
    table[0, 2] = 3  # block 1 is full: the block manager appends physical block 3
    step2 = pa.compute_slot_mapping(table, torch.tensor([0], dtype=torch.int32), torch.tensor([8], dtype=torch.int32), B)
    assert step2.tolist() == [12], "the second decoded token starts physical block 3"

    # Run it for real: write the 9 tokens where the slots say, attend, compare with dense.
    key_cache, value_cache = pa.allocate_kv_cache(8, B, 1, 16)
    key_cache.fill_(float("nan"))
    value_cache.fill_(float("nan"))
    g = torch.Generator().manual_seed(6)
    k, v, q = (torch.randn(9, 1, 16, generator=g) for _ in range(3))
    slots = torch.cat([prompt, step1, step2])
    pa.reshape_and_cache(k, v, key_cache, value_cache, slots)
    out = pa.paged_attention_decode(q[8:], key_cache, value_cache, table, torch.tensor([9], dtype=torch.int32), 0.25)
    expected = dense_causal_attention(q[8:], k, v, 0.25)
    assert (out - expected).abs().max() <= 1e-5, "attention over blocks 7, 1, 3 must equal dense attention over 9 tokens"


def test_slot_mapping_matches_hand_oracle(chapter):
    pa = chapter("paged_attention")

    @given(st.data())
    def run(data):
        batch = data.draw(ragged_batches(max_seqs=4, max_seq_len=80))
        bs = data.draw(block_sizes())
        layout = data.draw(block_layouts(batch.seq_lens, bs))
        req, pos = [], []
        for i, (s, q) in enumerate(zip(batch.seq_lens, batch.q_lens)):
            req += [i] * q
            pos += list(range(s - q, s))  # the new tokens of this step
        order = data.draw(st.permutations(range(len(req))))  # token order must not matter
        req = [req[t] for t in order]
        pos = [pos[t] for t in order]
        tables = torch.tensor(layout.block_tables, dtype=torch.int32)
        got = pa.compute_slot_mapping(tables, torch.tensor(req, dtype=torch.int32), torch.tensor(pos), bs)
        expected = [hand_slot(layout.block_tables[r], p, bs) for r, p in zip(req, pos)]
        assert got.dtype == torch.int64, "slot_mapping must be int64 (slots overflow int32 on big caches)"
        assert got.tolist() == expected, "slot != block_tables[req, pos // B] * B + pos % B"

    run()


def test_reshape_and_cache_writes_only_its_slots_and_skips_padding(chapter):
    pa = chapter("paged_attention")

    @given(st.data())
    def run(data):
        bs = data.draw(block_sizes())
        shape = data.draw(gqa_shapes())
        num_blocks = data.draw(st.integers(1, 6))
        n_real = data.draw(st.integers(0, min(20, num_blocks * bs)))
        slots = data.draw(st.permutations(range(num_blocks * bs)))[:n_real]
        n_pad = data.draw(st.integers(0, 4))
        slot_list = list(slots) + [-1] * n_pad
        slot_list = [slot_list[t] for t in data.draw(st.permutations(range(len(slot_list))))]
        dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
        key_cache, value_cache = pa.allocate_kv_cache(num_blocks, bs, shape.num_kv_heads, shape.head_dim, dtype)
        key_cache.fill_(float("nan"))
        value_cache.fill_(float("nan"))
        k = torch.randn(len(slot_list), shape.num_kv_heads, shape.head_dim).to(dtype)
        v = torch.randn(len(slot_list), shape.num_kv_heads, shape.head_dim).to(dtype)
        pa.reshape_and_cache(k, v, key_cache, value_cache, torch.tensor(slot_list, dtype=torch.int64))
        flat_k = key_cache.reshape(-1, shape.num_kv_heads, shape.head_dim)
        flat_v = value_cache.reshape(-1, shape.num_kv_heads, shape.head_dim)
        written = set()
        for t, s in enumerate(slot_list):
            if s == -1:
                continue  # padding: must not land anywhere (in particular not on the last slot)
            written.add(s)
            assert torch.equal(flat_k[s], k[t]) and torch.equal(flat_v[s], v[t]), f"token {t} not at slot {s}"
        untouched = [s for s in range(num_blocks * bs) if s not in written]
        assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all(), \
            "a slot outside slot_mapping was written (padding -1 wrapped to the last slot?)"

    run()


def test_round_trip_slot_mapping_cache_then_attention(chapter):
    """compute_slot_mapping -> reshape_and_cache (with padding tokens) ->
    paged_attention_varlen equals dense attention on the contiguous K/V."""
    pa = chapter("paged_attention")

    @given(st.data())
    def run(data):
        batch = data.draw(ragged_batches(max_seqs=3, max_seq_len=48))
        bs = data.draw(block_sizes())
        layout = data.draw(block_layouts(batch.seq_lens, bs))
        shape = data.draw(gqa_shapes())
        n_pad = data.draw(st.integers(0, 3))
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
        kvh, d = shape.num_kv_heads, shape.head_dim
        key_cache, value_cache = pa.allocate_kv_cache(layout.num_blocks, bs, kvh, d)
        key_cache.fill_(float("nan"))
        value_cache.fill_(float("nan"))
        tables = torch.tensor(layout.block_tables, dtype=torch.int32)
        ks = [torch.randn(s, kvh, d, generator=g) for s in batch.seq_lens]
        vs = [torch.randn(s, kvh, d, generator=g) for s in batch.seq_lens]
        req = torch.cat([torch.full((s,), i, dtype=torch.int32) for i, s in enumerate(batch.seq_lens)])
        pos = torch.cat([torch.arange(s, dtype=torch.int32) for s in batch.seq_lens])
        slots = pa.compute_slot_mapping(tables, req, pos, bs)
        # Padding tokens (as in a CUDA-graph padded batch) carry garbage and slot -1.
        slots = torch.cat([slots, torch.full((n_pad,), -1, dtype=torch.int64)])
        k_all = torch.cat(ks + [torch.full((n_pad, kvh, d), 1e4)])
        v_all = torch.cat(vs + [torch.full((n_pad, kvh, d), 1e4)])
        pa.reshape_and_cache(k_all, v_all, key_cache, value_cache, slots)
        qs = [torch.randn(q, shape.num_heads, d, generator=g) for q in batch.q_lens]
        cu = torch.tensor(batch.cu_seqlens_q, dtype=torch.int32)
        scale = 1.0 / math.sqrt(d)
        out = pa.paged_attention_varlen(torch.cat(qs), key_cache, value_cache, tables, cu,
                                        torch.tensor(batch.seq_lens, dtype=torch.int32), scale)
        for i in range(batch.num_seqs):
            expected = dense_causal_attention(qs[i], ks[i], vs[i], scale)
            err = (out[cu[i]:cu[i + 1]] - expected).abs().max().item()
            assert err <= 1e-5, f"seq {i}: round-trip error {err:.3g} (slot mapping and cache layout disagree?)"

    run()
