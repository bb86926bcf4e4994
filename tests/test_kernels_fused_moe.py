"""Triton fused MoE == the reference loop over experts (interpreter on CPU, compiled on a GPU).

The align step is checked on its own against invariants computed here from
topk_ids (each routed (token, slot) pair once, in its expert's segment,
padding only sentinels, pairs routed to -1 nowhere); the whole kernel against
`fused_experts_reference`.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mini_vllm.kernels.fused_moe import ALIGN_CHUNK, fused_experts_triton, moe_align_block_size
from mini_vllm.models.fused_moe import dispatch
from moe_kernel_cases import Routing, assert_matches_reference, make_experts, make_routing, routings

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check_alignment(topk_ids, block, num_experts, expert_map, sorted_ids, expert_ids, ntpp):
    """Every invariant of moe_align_block_size, from topk_ids alone."""
    flat = topk_ids.reshape(-1).long().cpu()
    numel = flat.numel()
    sorted_ids, expert_ids, ntpp = sorted_ids.long().cpu(), expert_ids.long().cpu(), int(ntpp.item())
    counts = [int((flat == e).sum()) for e in range(num_experts)]
    pos = 0
    for e in range(num_experts):  # segments in expert order, ids increasing, padding after
        if counts[e] == 0:
            continue
        seg = sorted_ids[pos: pos + -(-counts[e] // block) * block]
        real = seg[: counts[e]]
        assert real.numel() == real.unique().numel(), \
            f"a (token, slot) pair appears twice in expert {e}'s segment: the expert would run it twice"
        assert (seg[counts[e]:] == numel).all(), \
            f"expert {e}'s padding holds {seg[counts[e]:].tolist()}, not only the sentinel {numel}"
        assert torch.equal(seg[: counts[e]], torch.nonzero(flat == e).flatten()), \
            f"expert {e}'s segment at {pos} does not hold exactly its pairs in order"
        local = e if expert_map is None else int(expert_map[e])
        labels = expert_ids[pos // block: (pos + seg.numel()) // block]
        assert (labels == local).all(), f"expert {e}'s blocks labelled {labels.tolist()}, want local id {local}"
        pos += seg.numel()
    assert ntpp == pos, f"num_tokens_post_padded {ntpp}, want {pos} (segments not padded to {block})"
    assert (sorted_ids[ntpp:] == numel).all(), "slots past num_tokens_post_padded must hold the sentinel"
    assert (expert_ids[ntpp // block:] == -1).all(), "blocks past num_tokens_post_padded must be labelled -1"


@settings(max_examples=25)
@given(routings(max_tokens=80, max_k=8), st.sampled_from([16, 32, 64]))
def test_align_invariants(routing, block):
    _, ids, emap = make_routing(routing, DEVICE)
    check_alignment(ids, block, routing.num_experts, emap, *moe_align_block_size(ids, block, routing.num_experts, emap))


def test_align_spans_several_chunks():
    """More pairs than one align program reads per step: the scan over chunks must
    neither drop nor repeat the pairs at chunk edges."""
    r = Routing(num_tokens=2 * ALIGN_CHUNK // 3 + 7, num_experts=5, top_k=3, seed=3, unrouted=0.1)
    _, ids, _ = make_routing(r, DEVICE)
    assert ids.numel() > 2 * ALIGN_CHUNK
    check_alignment(ids, 16, 5, None, *moe_align_block_size(ids, 16, 5))


def test_align_worked_example():
    """3 tokens top-2 over 4 experts, block 4: expert 1 gets pairs 1, 2, 5; expert 2
    gets 0, 4; expert 3 gets 3; expert 0 none (no segment). Sentinel 6."""
    ids = torch.tensor([[2, 1], [1, 3], [2, 1]], dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, ntpp = moe_align_block_size(ids, 4, 4)
    assert int(ntpp.item()) == 12, "three experts with tokens, one block of 4 each"
    assert sorted_ids[:12].tolist() == [1, 2, 5, 6, 0, 4, 6, 6, 3, 6, 6, 6], "segments or padding misplaced"
    assert expert_ids[:3].tolist() == [1, 2, 3], "blocks labelled with the wrong experts"


CASES = {  # name -> (routing, H, I, block_m)
    "one_token_k1": (Routing(1, 8, 1, seed=1), 32, 16, None),
    "one_token_e64_k8": (Routing(1, 64, 8, seed=2), 32, 16, None),
    "k1_ragged": (Routing(19, 6, 1, seed=3), 32, 24, None),
    "e64_k8_most_experts_idle": (Routing(9, 64, 8, seed=4, skew=4.0), 48, 16, None),
    "several_blocks_per_expert": (Routing(40, 3, 2, seed=5), 40, 24, 16),
    "expert_map_with_minus_one": (Routing(17, 12, 4, seed=6, num_local=5), 32, 16, None),
    "unrouted_slots": (Routing(13, 8, 3, seed=7, unrouted=0.3), 32, 16, None),
}


# Every case in fp32; half precision on the shapes that cover the most paths.
HALF_CASES = ("one_token_e64_k8", "several_blocks_per_expert", "expert_map_with_minus_one")
PARAMS = [(c, torch.float32) for c in CASES] + [(c, d) for c in HALF_CASES for d in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("case,dtype", PARAMS, ids=[f"{c}-{str(d)[6:]}" for c, d in PARAMS])
def test_kernel_equals_reference(case, dtype):
    routing, hidden, inter, block_m = CASES[case]
    weights, ids, emap = make_routing(routing, DEVICE)
    num_local = routing.num_local or routing.num_experts
    x, w13, w2 = make_experts(routing.num_tokens, hidden, inter, num_local, dtype, routing.seed, DEVICE)
    got = fused_experts_triton(x, w13, w2, weights, ids, emap, block_m=block_m)
    assert_matches_reference(got, x, w13, w2, weights, ids, emap, f"{case} {dtype}")


@settings(max_examples=15)
@given(routings(max_tokens=12, max_experts=16, max_k=4), st.sampled_from([16, 32]))
def test_kernel_equals_reference_on_drawn_routings(routing, block_m):
    weights, ids, emap = make_routing(routing, DEVICE)
    x, w13, w2 = make_experts(routing.num_tokens, 32, 16, routing.num_local or routing.num_experts,
                              torch.float32, routing.seed, DEVICE)
    got = fused_experts_triton(x, w13, w2, weights, ids, emap, block_m=block_m)
    assert_matches_reference(got, x, w13, w2, weights, ids, emap, f"{routing} block_m={block_m}")


def test_tokens_with_no_local_expert_are_exactly_zero():
    """Rows of pairs on another rank or routed to -1 are skipped, never computed:
    a token with no local expert gets an output of exact zeros."""
    weights, ids, _ = make_routing(Routing(6, 4, 2, seed=8), DEVICE)
    ids[0] = torch.tensor([1, 3])
    ids[1] = torch.tensor([-1, 3])
    emap = torch.tensor([0, -1, 1, -1], dtype=torch.int32, device=DEVICE)
    x, w13, w2 = make_experts(6, 32, 16, 2, torch.float32, 8, DEVICE)
    got = fused_experts_triton(x, w13, w2, weights, ids, emap)
    assert (got[:2] == 0).all(), "a token whose experts are all off this rank got a nonzero output"
    assert_matches_reference(got, x, w13, w2, weights, ids, emap, "no-local-expert tokens")


def bad_args():
    weights, ids, _ = make_routing(Routing(4, 4, 2, seed=9))
    x, w13, w2 = make_experts(4, 32, 16, 4, torch.float32, 9)
    good = dict(hidden=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids, expert_map=None)
    return [
        ({"w13": w13[:, :, :16]}, "w13 must be"),
        ({"w2": w2[:3]}, "w2 must be"),
        ({"w2": w2.double()}, "w2 must have dtype"),
        ({"hidden": x.long()}, "hidden must have dtype"),
        ({"topk_ids": ids + 3}, r"topk_ids must lie in \[-1, num_experts=4\)"),
        ({"topk_ids": ids.float()}, "topk_ids must have dtype"),
        ({"topk_weights": weights[:3]}, "must both be"),
        ({"expert_map": torch.tensor([0, 1, 2, 4])}, r"expert_map entries must lie in \[-1, local experts=4\)"),
    ], good


@pytest.mark.parametrize("i", range(8))
def test_bad_input_names_the_field(i):
    cases, good = bad_args()
    change, message = cases[i]
    with pytest.raises(ValueError, match=message):
        fused_experts_triton(**{**good, **change})


def test_bad_block_sizes():
    cases, good = bad_args()
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        fused_experts_triton(**good, block_m=24)
    with pytest.raises(ValueError, match="expert_map must have num_experts=4 entries"):
        moe_align_block_size(good["topk_ids"], 16, 4, torch.zeros(3, dtype=torch.int32))


def test_dispatch_forces_each_implementation(monkeypatch):
    weights, ids, _ = make_routing(Routing(5, 4, 2, seed=10), DEVICE)
    x, w13, w2 = make_experts(5, 32, 16, 4, torch.float32, 10, DEVICE)
    for impl in ("reference", "triton"):
        monkeypatch.setenv(dispatch.MOE_IMPL_ENV, impl)
        assert dispatch.select_impl(x) == impl, f"{dispatch.MOE_IMPL_ENV}={impl} was not honoured"
        assert_matches_reference(dispatch.fused_experts(x, w13, w2, weights, ids), x, w13, w2, weights, ids,
                                 None, f"dispatch forced to {impl}")
    monkeypatch.setenv(dispatch.MOE_IMPL_ENV, "fast")
    with pytest.raises(ValueError, match="MINI_VLLM_MOE_IMPL='fast' is not one of auto, reference, triton, cpu"):
        dispatch.fused_experts(x, w13, w2, weights, ids)
    monkeypatch.delenv(dispatch.MOE_IMPL_ENV)
    if DEVICE == "cuda":
        assert dispatch.select_impl(x) == "triton", "auto must pick Triton for CUDA tensors"
    assert dispatch.select_impl(x.cpu().half()) == "reference", "fp16 on the CPU has no fast path: the reference"
