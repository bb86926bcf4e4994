"""Qwen3: Llama plus a per-head RMSNorm on q and k, applied BEFORE RoPE.

vLLM counterpart: `vllm/model_executor/models/qwen3.py` (`Qwen3Attention`,
`Qwen3ForCausalLM`).

Invariants: `q_norm` / `k_norm` have head_dim weights shared by all heads and
normalise each head's vector on its own; they run on the projected q/k before
the rotation (rotating first would give different numbers).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import RMSNorm
from .llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, attention_backend: str):
        super().__init__(config, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                         attention_backend=attention_backend)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        t = q.shape[0]
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        return q, k


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ModelConfig, backend: str) -> nn.Module:
        return Qwen3Attention(config, attention_backend=backend)
