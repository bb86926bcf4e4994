"""Routings and expert weights for the fused-MoE kernel tests (Triton and CPU).

A routing is what a router hands `fused_experts`: per token k distinct
global expert ids with float32 weights, optionally an `expert_map` (global id
-> local index, -1 for another rank's expert) and ids -1 (no expert). The
oracle is `mini_vllm.models.fused_moe.fused_experts_reference`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from mini_vllm.models.fused_moe.reference import fused_experts_reference

# Max abs error allowed, relative to max(1, |reference|): fp32 differs only in
# summation order; bf16/fp16 references round their intermediates to the dtype,
# the kernels keep them in fp32, so one or two units in the last place.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Routing:
    num_tokens: int
    num_experts: int  # global
    top_k: int
    seed: int
    num_local: int | None = None  # experts on this rank (expert_map drawn) or None (no expert_map)
    unrouted: float = 0.0  # share of (token, slot) ids set to -1
    skew: float = 0.0  # > 0 concentrates tokens on few experts (many experts get none)


@st.composite
def routings(draw, max_tokens: int = 24, max_experts: int = 64, max_k: int = 8) -> Routing:
    num_experts = draw(st.integers(1, max_experts))
    top_k = draw(st.integers(1, min(max_k, num_experts)))
    num_local = draw(st.one_of(st.none(), st.integers(1, num_experts)))
    return Routing(draw(st.integers(1, max_tokens)), num_experts, top_k, draw(st.integers(0, 2**31 - 1)),
                   num_local, draw(st.sampled_from([0.0, 0.0, 0.25])), draw(st.sampled_from([0.0, 3.0])))


def make_routing(r: Routing, device="cpu"):
    """(topk_weights [T, k] fp32, topk_ids [T, k] int32, expert_map or None)."""
    g = torch.Generator().manual_seed(r.seed)
    # Distinct experts per token: the first k of a random order, biased by
    # `skew` toward low ids so that many experts get no token.
    scores = torch.rand(r.num_tokens, r.num_experts, generator=g) - r.skew * torch.arange(r.num_experts) / r.num_experts
    ids = scores.topk(r.top_k, dim=1).indices.to(torch.int32)
    if r.unrouted:
        ids[torch.rand(ids.shape, generator=g) < r.unrouted] = -1
    weights = torch.rand(r.num_tokens, r.top_k, generator=g) + 0.1
    weights = weights / weights.sum(dim=1, keepdim=True)
    expert_map = None
    if r.num_local is not None:
        expert_map = torch.full((r.num_experts,), -1, dtype=torch.int32)
        chosen = torch.randperm(r.num_experts, generator=g)[: r.num_local]
        expert_map[chosen] = torch.randperm(r.num_local, generator=g).to(torch.int32)
        expert_map = expert_map.to(device)
    return weights.to(device), ids.to(device), expert_map


def make_experts(num_tokens: int, hidden: int, inter: int, num_local: int, dtype, seed: int, device="cpu"):
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], scaled so outputs are O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=g) / hidden ** 0.5 * 2
    w2 = torch.randn(num_local, hidden, inter, generator=g) / inter ** 0.5 * 2
    return [t.to(device=device, dtype=dtype) for t in (x, w13, w2)]


def assert_matches_reference(got, hidden, w13, w2, weights, ids, expert_map, what: str):
    """got equals the oracle up to the dtype's tolerance; bf16/fp16 also against
    the fp32 oracle on the upcast inputs (the kernels compute in fp32)."""
    want = fused_experts_reference(hidden.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu(),
                                   None if expert_map is None else expert_map.cpu())
    assert got.dtype == hidden.dtype and got.shape == hidden.shape, \
        f"{what}: output {got.dtype} {tuple(got.shape)}, want hidden's {hidden.dtype} {tuple(hidden.shape)}"
    got = got.float().cpu()
    tol = TOL[hidden.dtype] * max(1.0, float(want.float().abs().max()))
    err = float((got - want.float()).abs().max())
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g} against the reference loop"
    if hidden.dtype != torch.float32:
        want32 = fused_experts_reference(hidden.cpu().float(), w13.cpu().float(), w2.cpu().float(),
                                         weights.cpu(), ids.cpu(), None if expert_map is None else expert_map.cpu())
        err32 = float((got - want32).abs().max())
        assert err32 <= tol, f"{what}: max abs error {err32:.3g} > {tol:.3g} against the fp32 reference"
