"""The runner's input preparation (runs under --impl=exercise too).

Oracle: a per-token Python loop written from the definitions, plus the
model runner's own tensors for a traced step checked position by position.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def eng(chapter):
    return chapter("engine")


def test_hand_example(eng):
    # Request 0: decode at position 7. Request 1: chunk of 3 after 16 computed (a prefix hit).
    # Request 2: a fresh 2-token prefill.
    comp, sched = np.array([7, 16, 0]), np.array([1, 3, 2])
    assert eng.compute_query_start_loc(sched).tolist() == [0, 1, 4, 6], (
        "query_start_loc must be the running sum of the scheduled counts after a leading 0, got "
        f"{eng.compute_query_start_loc(sched).tolist()}")
    assert eng.compute_query_start_loc(sched).dtype == np.int32, "query_start_loc must be int32"
    pos = eng.compute_positions(comp, sched)
    assert pos.tolist() == [7, 16, 17, 18, 0, 1], \
        "positions must start at num_computed_tokens (not 0) and run request by request"
    assert pos.dtype == np.int64, f"positions must be int64 (the model's position ids), got {pos.dtype}"
    table = np.array([[4, 9, -1], [2, 5, 8], [11, -1, -1]], dtype=np.int32)
    req_idx = np.array([0, 1, 1, 1, 2, 2])
    slots = eng.compute_slot_mapping(table, req_idx, pos, 8)
    assert slots.tolist() == [4 * 8 + 7, 8 * 8 + 0, 8 * 8 + 1, 8 * 8 + 2, 11 * 8, 11 * 8 + 1], \
        "slot = block_table[req, pos // block_size] * block_size + pos % block_size"
    assert slots.dtype == np.int64, "slots must be int64 (they overflow int32 on large caches)"


def test_empty_batch(eng):
    assert eng.compute_query_start_loc(np.zeros(0, dtype=np.int64)).tolist() == [0], (
        f"an empty batch's query_start_loc must be [0], got {eng.compute_query_start_loc(np.zeros(0, dtype=np.int64))}")


@st.composite
def batches(draw):
    n = draw(st.integers(1, 12))
    bs = draw(st.sampled_from([8, 16, 32]))
    comp = draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    sched = draw(st.lists(st.integers(1, 200), min_size=n, max_size=n))
    max_blocks = max(-(-(c + d) // bs) for c, d in zip(comp, sched)) + 1
    perm = draw(st.permutations(range(n * max_blocks)))
    table = np.array(perm, dtype=np.int32).reshape(n, max_blocks)
    return np.array(comp), np.array(sched), table, bs


@given(batches())
def test_against_per_token_loop(eng, batch):
    comp, sched, table, bs = batch
    want_pos, want_slots, want_idx = [], [], []
    for i, (c, d) in enumerate(zip(comp, sched)):
        for p in range(c, c + d):
            want_pos.append(p)
            want_idx.append(i)
            want_slots.append(int(table[i][p // bs]) * bs + p % bs)
    loc = eng.compute_query_start_loc(sched)
    assert loc.tolist() == [0] + np.cumsum(sched).tolist(), (
        "query_start_loc differs from [0] + cumsum(num_scheduled) (the leading 0 missing, or off by one?): "
        f"{loc.tolist()}")
    pos = eng.compute_positions(comp, sched)
    assert pos.tolist() == want_pos, "positions differ from the per-token definition"
    slots = eng.compute_slot_mapping(table, np.array(want_idx), pos, bs)
    assert slots.tolist() == want_slots, "slot mapping differs from the per-token definition"


@given(batches())
def test_the_same_slot_mapping_as_chapter_1(eng, batch):
    """One concept under one name: the engine's numpy `compute_slot_mapping` (host arrays,
    no checks: the scheduler allocated every block it schedules) is Chapter 1's checked
    torch function. Oracle: Chapter 1's reference."""
    import torch

    from mini_vllm.paged_attention import compute_slot_mapping as chapter1_slots
    comp, sched, table, bs = batch
    req_idx = np.repeat(np.arange(len(sched)), sched)
    pos = np.concatenate([np.arange(c, c + d) for c, d in zip(comp, sched)])
    want = chapter1_slots(torch.from_numpy(table), torch.from_numpy(req_idx), torch.from_numpy(pos), bs)
    got = eng.compute_slot_mapping(table, req_idx, pos, bs)
    assert got.tolist() == want.tolist(), "the engine's slot mapping differs from Chapter 1's for the same batch"
