"""The router's top-k: which k experts each token goes to, and with what weights.

vLLM counterpart: `fused_topk` in `vllm/model_executor/layers/fused_moe/router/`
(a fused softmax + top-k + renormalise op; here in plain PyTorch).

Computed from the logits, not from the full softmax: the k largest logits
pick the same experts as the k largest probabilities (softmax is monotone),
and a picked expert's probability is exp(logit - logsumexp(all logits)).
With `renormalize` the weights are divided by their sum, which equals a
softmax over the k picked logits alone. `reference.fused_topk_reference`
(softmax over all E, then top-k) is the oracle this is checked against.

Invariants: weights [T, k] float32, ids [T, k] int32 in [0, E); a token's k
ids are distinct; with `renormalize` each row of weights sums to 1, without it
to the probability mass of the k experts (< 1 unless k = E).
"""
from __future__ import annotations

import torch


def fused_topk(gating_output: torch.Tensor, topk: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32)."""
    if gating_output.dim() != 2:
        raise ValueError(f"gating_output must be [num_tokens, num_experts], got shape "
                         f"{tuple(gating_output.shape)}")
    num_experts = gating_output.shape[1]
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be an int in [1, num_experts={num_experts}], got {topk!r}")
    logits = gating_output.float()  # float32 routing whatever the model dtype (vLLM and HF do too)
    top_logits, ids = torch.topk(logits, topk, dim=-1)
    if renormalize:
        weights = torch.softmax(top_logits, dim=-1)  # = p_i / sum of the k picked p's
    else:
        weights = torch.exp(top_logits - torch.logsumexp(logits, dim=-1, keepdim=True))
    return weights, ids.to(torch.int32)
