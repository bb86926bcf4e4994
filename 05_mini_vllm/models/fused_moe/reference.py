"""The plain-PyTorch mixture-of-experts oracle: routing and a loop over experts.

vLLM counterparts: `fused_topk` (`vllm/model_executor/layers/fused_moe/router/`)
and `fused_experts` (`vllm/model_executor/layers/fused_moe/fused_moe.py`);
the loop mirrors Hugging Face's `Qwen3MoeSparseMoeBlock`.

Shapes (vLLM's): hidden [T, H]; w13 [E, 2*I, H], gate rows first then up rows;
w2 [E, H, I]; topk_weights [T, k] float32; topk_ids [T, k] int (global expert ids).

Invariants:
* routing: softmax over all E experts in float32, the k largest kept; with
  `renormalize` (the config's `norm_topk_prob`) they are divided by their sum,
  so every token's weights add to 1; without it they keep their softmax mass;
* a token's k ids are distinct (top-k never picks an expert twice), and each
  (token, expert) pair contributes exactly once;
* out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),
  e = topk_ids[t, j]; accumulated in float32, cast to hidden's dtype once;
* expert parallelism: with `expert_map` (global id -> local index, -1 where
  another rank holds the expert) only local experts contribute; the ranks'
  partial outputs then add up (an all-reduce) to the EP = 1 result.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_topk_reference(gating_output: torch.Tensor, topk: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, ids [T, k] int32)."""
    if gating_output.dim() != 2:
        raise ValueError(f"gating_output must be [num_tokens, num_experts], got shape "
                         f"{tuple(gating_output.shape)}")
    num_experts = gating_output.shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
    probs = torch.softmax(gating_output.float(), dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_experts_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: for each expert, gather its tokens, run its MLP, scatter-add weighted."""
    num_tokens, hidden_size = hidden.shape
    num_local, two_i, h_in = w13.shape
    if h_in != hidden_size or w2.shape != (num_local, hidden_size, two_i // 2):
        raise ValueError(f"expert weights do not match: hidden {tuple(hidden.shape)}, "
                         f"w13 {tuple(w13.shape)} (want [E, 2I, H]), w2 {tuple(w2.shape)} (want [E, H, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [num_tokens={num_tokens}, k]")
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    if expert_map is not None:
        ids = torch.where(ids >= 0, expert_map.long()[ids.clamp(min=0)], ids)
    for e in range(num_local):
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue  # an expert no token chose: nothing to add
        x = hidden[token_idx]
        gate_up = F.linear(x, w13[e])
        inter = F.silu(gate_up[:, : two_i // 2]) * gate_up[:, two_i // 2:]
        y = F.linear(inter, w2[e]).float()
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot].float()[:, None])
    return out.to(hidden.dtype)
