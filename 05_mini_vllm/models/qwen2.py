"""Qwen2: Llama with biases on the q/k/v projections (none on o_proj).

vLLM counterpart: `vllm/model_executor/models/qwen2.py` (`Qwen2ForCausalLM`).

Invariant: q_proj, k_proj and v_proj always carry a bias (Qwen2 configs have
no `attention_bias` switch); o_proj and the MLP never do.
"""
from __future__ import annotations

from torch import nn

from .config import ModelConfig
from .llama import LlamaAttention, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ModelConfig, backend: str) -> nn.Module:
        return LlamaAttention(config, qkv_bias=True, o_bias=False, attention_backend=backend)
