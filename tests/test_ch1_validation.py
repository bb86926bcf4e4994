"""Chapter 1: bad input raises a ValueError naming the argument."""
import pytest
import torch


def good(pa):
    kc, vc = pa.allocate_kv_cache(4, 8, 2, 16)
    return dict(
        query=torch.randn(3, 4, 16),
        key_cache=kc,
        value_cache=vc,
        block_tables=torch.tensor([[0, 1], [2, -1], [3, -1]], dtype=torch.int32),
        seq_lens=torch.tensor([9, 8, 1], dtype=torch.int32),
        scale=0.25,
    )


def decode_cases(pa):
    kc, vc = pa.allocate_kv_cache(4, 8, 2, 16)
    return [
        ("query", dict(query=torch.randn(3, 4))),
        ("query", dict(query=torch.randn(3, 4, 16, dtype=torch.float64))),
        ("head_dim", dict(query=torch.randn(3, 4, 32))),
        ("num_heads", dict(query=torch.randn(3, 3, 16))),
        ("value_cache", dict(value_cache=vc.half())),
        ("value_cache", dict(value_cache=vc[:2])),
        ("key_cache", dict(key_cache=kc.double(), value_cache=vc.double())),
        ("block_tables", dict(block_tables=torch.tensor([[0, 1], [2, -1], [3, -1]], dtype=torch.int64))),
        ("block_tables", dict(block_tables=torch.tensor([[0, 1], [2, -1]], dtype=torch.int32))),
        ("block_tables", dict(block_tables=torch.tensor([[0, 1], [-1, 2], [3, -1]], dtype=torch.int32))),
        ("block_tables", dict(block_tables=torch.tensor([[0, 9], [2, -1], [3, -1]], dtype=torch.int32))),
        ("seq_lens", dict(seq_lens=torch.tensor([9, 8, 0], dtype=torch.int32))),
        ("seq_lens", dict(seq_lens=torch.tensor([17, 8, 1], dtype=torch.int32))),
        ("seq_lens", dict(seq_lens=[9, 8, 1])),
        ("scale", dict(scale=0.0)),
        ("scale", dict(scale=float("nan"))),
    ]


def test_decode_bad_inputs(chapter):
    pa = chapter("paged_attention")
    for name, override in decode_cases(pa):
        with pytest.raises(ValueError, match=name):
            pa.paged_attention_decode(**{**good(pa), **override})


def test_varlen_bad_cu_seqlens(chapter):
    pa = chapter("paged_attention")
    args = good(pa)
    for cu in ([0, 1, 2], [1, 2, 3, 3], [0, 1, 1, 3], [0, 1, 2, 4], [0, 3, 4, 5]):
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            pa.paged_attention_varlen(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                                      torch.tensor(cu, dtype=torch.int32), args["seq_lens"], args["scale"])
    # q_len 2 > seq_len 1 for the last sequence
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        pa.paged_attention_varlen(torch.randn(4, 4, 16), args["key_cache"], args["value_cache"], args["block_tables"],
                                  torch.tensor([0, 1, 2, 4], dtype=torch.int32), args["seq_lens"], args["scale"])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        pa.paged_attention_varlen(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                                  torch.tensor([0, 1, 2, 3], dtype=torch.int64), args["seq_lens"], args["scale"])


def test_reshape_and_cache_bad_inputs(chapter):
    pa = chapter("paged_attention")
    kc, vc = pa.allocate_kv_cache(2, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([0, 5, -1])
    cases = [
        ("key", dict(key=torch.randn(3, 2, 8).half())),
        ("key", dict(key=torch.randn(3, 1, 8))),
        ("value", dict(value=torch.randn(2, 2, 8))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([0, 8, -1]))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([0, -2, 1]))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([0, 1]))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0]))),
        ("value_cache", dict(value_cache=vc[:, :2])),
    ]
    for name, override in cases:
        kw = {**dict(key=k, value=v, key_cache=kc, value_cache=vc, slot_mapping=slots), **override}
        with pytest.raises(ValueError, match=name):
            pa.reshape_and_cache(**kw)


def test_slot_mapping_bad_inputs(chapter):
    pa = chapter("paged_attention")
    table = torch.tensor([[3, -1]], dtype=torch.int32)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    cases = [
        ("block_tables", (table.long(), i32([0]), i32([0]), 4)),
        ("block_tables", (table, i32([0]), i32([5]), 4)),  # position 5 -> entry -1
        ("positions", (table, i32([0]), i32([8]), 4)),
        ("positions", (table, i32([0]), i32([-1]), 4)),
        ("req_indices", (table, i32([1]), i32([0]), 4)),
        ("req_indices", (table, i32([0, 0]), i32([0]), 4)),
        ("block_size", (table, i32([0]), i32([0]), 0)),
    ]
    for name, args in cases:
        with pytest.raises(ValueError, match=name):
            pa.compute_slot_mapping(*args)


def test_allocate_kv_cache_bad_inputs(chapter):
    pa = chapter("paged_attention")
    for name, kw in [("num_blocks", dict(num_blocks=0)), ("block_size", dict(block_size=-1)),
                     ("head_dim", dict(head_dim=2.5)), ("dtype", dict(dtype=torch.int8))]:
        args = {**dict(num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8), **kw}
        with pytest.raises(ValueError, match=name):
            pa.allocate_kv_cache(**args)
