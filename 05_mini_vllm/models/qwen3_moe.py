"""Qwen3-MoE: Qwen3 with a mixture of experts in place of the MLP of its sparse layers.

vLLM counterpart: `vllm/model_executor/models/qwen3_moe.py`
(`Qwen3MoeSparseMoeBlock`, `Qwen3MoeForCausalLM`).

Invariants:
* attention is Qwen3's (per-head q/k RMSNorm before RoPE);
* layer i has a `Qwen3MoeSparseMoeBlock` iff i is not in `mlp_only_layers`
  and (i + 1) % decoder_sparse_step == 0 (`moe_config.is_sparse_layer`); the
  others a dense MLP of the config's `intermediate_size`;
* a sparse block: router logits from `gate` (replicated: every rank routes
  every token alike), then `experts` (a `FusedMoE`: softmax, top
  num_experts_per_tok, renormalised iff norm_topk_prob, the experts' SiLU MLPs
  of width moe_intermediate_size, weighted sum);
* `enable_expert_parallel` (vLLM's flag, used only with tensor_parallel_size >
  1): each rank holds num_experts / tp whole experts instead of every expert's
  1/tp columns; the tokens and logits are the same either way.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .fused_moe.layer import FusedMoE
from .linear import ReplicatedLinear
from .moe_config import is_sparse_layer
from .qwen3 import Qwen3ForCausalLM


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router + experts; parameter names are the checkpoint's (`mlp.gate`, `mlp.experts`)."""

    def __init__(self, config: ModelConfig, enable_expert_parallel: bool):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=config.norm_topk_prob,
                                enable_expert_parallel=enable_expert_parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config: ModelConfig, attention_backend: str = "torch",
                 enable_expert_parallel: bool = False):
        if config.num_experts < 1:
            raise ValueError(f"Qwen3MoeForCausalLM needs num_experts >= 1, got {config.num_experts}")
        # read by make_mlp, which the base class calls while it builds the layers
        self.enable_expert_parallel = enable_expert_parallel
        super().__init__(config, attention_backend=attention_backend)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return Qwen3MoeSparseMoeBlock(config, self.enable_expert_parallel)
        return super().make_mlp(config, layer_idx)

    def moe_layers(self) -> list[FusedMoE]:
        """The FusedMoE of every sparse layer, in layer order."""
        return [m for m in self.modules() if isinstance(m, FusedMoE)]
