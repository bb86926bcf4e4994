"""Chapter 5, mixture of experts: the router's top-k and the FusedMoE layer.

Oracles: `fused_topk_reference` / `fused_experts_reference` (softmax over all
experts, then a loop over experts) and hand-made rows. The router tests take
the implementation under test (`chapter("engine").fused_topk`), so they grade
the exercise too (--impl=exercise). The layer tests load Hugging Face's
per-expert tensors and transformers 5's fused tensors through the layer's
weight loader, and check that the ranks' partial outputs under expert
parallelism and under the column split add up to the one-rank layer.
"""
from __future__ import annotations

import pytest
import torch

from mini_vllm.distributed import GroupCoordinator, use_tp_group
from mini_vllm.models.fused_moe import fused_experts_reference, fused_topk_reference
from mini_vllm.models.fused_moe.layer import FusedMoE


@pytest.fixture
def eng(chapter):
    return chapter("engine")


def test_router_hand_row(eng):
    # probabilities 0.4, 0.3, 0.2, 0.1: top-2 keeps experts 0 and 1
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    w, ids = eng.fused_topk(logits, 2, True)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32, "ids are int32 and weights float32 (vLLM's)"
    assert ids.tolist() == [[0, 1]], "top-2 must pick the two most probable experts, most probable first"
    assert torch.allclose(w, torch.tensor([[4 / 7, 3 / 7]])), \
        "norm_topk_prob: the kept weights are divided by their sum (0.4/0.7, 0.3/0.7)"
    w, _ = eng.fused_topk(logits, 2, False)
    assert torch.allclose(w, torch.tensor([[0.4, 0.3]])), \
        "without norm_topk_prob the kept weights keep their softmax mass over ALL experts (0.4, 0.3)"


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (37, 8, 2), (64, 64, 8), (5, 4, 4), (9, 16, 1)])
def test_router_matches_reference(eng, tokens, experts, k, renormalize):
    g = torch.Generator().manual_seed(tokens * 100 + experts + k)
    logits = torch.randn(tokens, experts, generator=g) * 3
    w, ids = eng.fused_topk(logits, k, renormalize)
    rw, rids = fused_topk_reference(logits, k, renormalize)
    assert tuple(ids.shape) == (tokens, k) and tuple(w.shape) == (tokens, k), f"want [T={tokens}, k={k}]"
    for row in ids.tolist():
        assert len(set(row)) == k, f"a token sent to one expert twice: ids {row}"
    assert torch.equal(ids.long(), rids.long()), "the k experts of a token (largest probability first) differ"
    assert torch.allclose(w, rw, atol=1e-6), f"top-k weights differ from softmax-then-top-k (renormalize={renormalize})"
    sums = w.sum(-1)
    if renormalize:
        assert torch.allclose(sums, torch.ones(tokens), atol=1e-6), "norm_topk_prob: each token's weights sum to 1"
    elif k < experts:
        assert (sums < 1).all(), "without norm_topk_prob the weights of k < E experts sum to less than 1"


def test_router_bad_input(eng):
    with pytest.raises(ValueError, match="topk"):
        eng.fused_topk(torch.zeros(3, 4), 5, True)
    with pytest.raises(ValueError, match="topk"):
        eng.fused_topk(torch.zeros(3, 4), 0, True)
    with pytest.raises(ValueError, match="num_tokens, num_experts"):
        eng.fused_topk(torch.zeros(4), 1, True)


E, K, H, INTER = 8, 2, 16, 12


def _hf_experts(seed: int, experts: int = E):
    """Per-expert tensors as Hugging Face's files hold them: gate/up [I, H], down [H, I]."""
    g = torch.Generator().manual_seed(seed)
    return [{p: torch.randn(*(s), generator=g) * 0.3 for p, s in
             (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER)))}
            for _ in range(experts)]


def _build(group=None, ep=False, renormalize=True, experts=E):
    with use_tp_group(group):
        return FusedMoE(experts, K, H, INTER, renormalize=renormalize, enable_expert_parallel=ep)


def _load_per_expert(layer: FusedMoE, hf) -> None:
    for prefix, (pname, shard) in layer.checkpoint_layouts("x")[0].items():
        e, part = int(prefix.split(".")[1]), prefix.split(".")[2]
        param = getattr(layer, pname.split(".")[-1])
        param.weight_loader(param, hf[e][part], shard)


def _stacked(hf):
    w13 = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in hf])
    return w13, torch.stack([x["down_proj"] for x in hf])


def _inputs(tokens=29, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g), torch.randn(tokens, E, generator=g) * 2


@pytest.mark.parametrize("renormalize", [True, False])
def test_layer_loads_per_expert_tensors_and_matches_reference(renormalize):
    hf = _hf_experts(1)
    layer = _build(renormalize=renormalize)
    _load_per_expert(layer, hf)
    w13, w2 = _stacked(hf)
    assert torch.equal(layer.w13_weight, w13), "w13 must hold each expert's gate rows, then its up rows"
    assert torch.equal(layer.w2_weight, w2), "w2 must hold each expert's down projection"
    x, logits = _inputs()
    with torch.no_grad():
        got = layer(x, logits)
    want = fused_experts_reference(x, w13, w2, *fused_topk_reference(logits, K, renormalize))
    assert torch.allclose(got, want, atol=1e-5), f"FusedMoE differs from the reference loop (renormalize={renormalize})"


def test_layer_loads_fused_tensors_like_per_expert():
    hf = _hf_experts(2)
    w13, w2 = _stacked(hf)
    layer = _build()
    for name, (pname, shard) in layer.checkpoint_layouts("x")[1].items():
        param = getattr(layer, pname.split(".")[-1])
        param.weight_loader(param, w13 if name.endswith("gate_up_proj") else w2, shard)
    assert torch.equal(layer.w13_weight, w13) and torch.equal(layer.w2_weight, w2), \
        "fused experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I] must load unchanged"


@pytest.mark.parametrize("ep", [True, False], ids=["expert-parallel", "column-split"])
def test_ranks_partial_outputs_add_up_to_one_rank(ep):
    hf = _hf_experts(4)
    whole = _build()
    _load_per_expert(whole, hf)
    x, logits = _inputs(41, seed=5)
    with torch.no_grad():
        want = whole.apply(x, logits)
        parts = []
        for rank in range(2):
            layer = _build(GroupCoordinator(rank=rank, world_size=2), ep=ep)
            _load_per_expert(layer, hf)
            if ep:
                assert layer.local_num_experts == E // 2 and layer.w13_weight.shape[1] == 2 * INTER
                held = [e for e in range(E) if layer.expert_map[e] >= 0]
                assert held == list(range(rank * E // 2, (rank + 1) * E // 2)), \
                    f"rank {rank} holds experts {held}: the expert offset is wrong"
                assert torch.equal(layer.w13_weight, whole.w13_weight[rank * E // 2:(rank + 1) * E // 2]), \
                    f"rank {rank} loaded other experts' weights than the ones its expert_map names"
            else:
                assert layer.expert_map is None and layer.w13_weight.shape == (E, INTER, H)
            parts.append(layer.apply(x, logits))
    assert torch.allclose(parts[0] + parts[1], want, atol=1e-5), \
        f"{'expert-parallel' if ep else 'column-split'} ranks' partial outputs do not add up to the one-rank layer"
    assert not torch.allclose(parts[0], want, atol=1e-3), "one rank alone must not already give the whole layer"


def test_bad_shapes_and_splits_are_clear_errors():
    layer = _build()
    param = layer.w13_weight
    with pytest.raises(ValueError, match=r"expert 3 'w1'.*\(12, 17\).*\(12, 16\)"):
        param.weight_loader(param, torch.zeros(INTER, H + 1), (3, "w1"))
    with pytest.raises(ValueError, match="fused experts"):
        param.weight_loader(param, torch.zeros(E, INTER, H), ("all", "w13"))
    with pytest.raises(ValueError, match="router_logits"):
        layer(torch.zeros(3, H), torch.zeros(3, E + 1))
    with pytest.raises(ValueError, match="hidden"):
        layer(torch.zeros(3, H + 1), torch.zeros(3, E))
    with pytest.raises(ValueError, match=r"num_experts \(8\).*tensor_parallel_size \(3\)"):
        _build(GroupCoordinator(rank=0, world_size=3), ep=True)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(12\).*tensor_parallel_size \(5\)"):
        _build(GroupCoordinator(rank=0, world_size=5), ep=False)
    with pytest.raises(ValueError, match="top_k"):
        FusedMoE(4, 5, H, INTER, renormalize=True)
