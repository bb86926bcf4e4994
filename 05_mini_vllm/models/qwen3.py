"""Qwen3: Llama plus a per-head RMSNorm on q and k, applied BEFORE RoPE.

vLLM counterpart: `vllm/model_executor/models/qwen3.py` (`Qwen3Attention`,
`Qwen3ForCausalLM`).

Invariants: `q_norm` / `k_norm` have head_dim weights shared by all heads and
normalise each head's vector on its own; they run on the projected q/k before
the rotation (rotating first would give different numbers). On the CPU the two
norms and the rotation run as one fused op over the projection's output (vLLM
fuses the same three in its compiled graph); its bits equal the three ops'.
"""
from __future__ import annotations

import torch
from torch import nn

from mini_vllm.kernels import cpu_layer_ops

from . import cpu_ops
from .config import ModelConfig
from .layers import RMSNorm
from .llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    qk_kernel = "qk_norm_rope"  # the flat CPU step's one op for both norms and the rotation

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

    def position_qk(self, positions: torch.Tensor, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # On the CPU both norms and the rotation are one fused op that reads qkv in place
        # (same bits as the three ops apart); elsewhere, and for the learner, the torch code.
        rope = self.rotary_emb
        if cpu_ops.fused(qkv, self.q_norm.weight, self.k_norm.weight) and qkv.is_contiguous():
            return cpu_layer_ops.qk_norm_rope(positions, qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                              self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                              rope.cos_cache, rope.sin_cache)
        return super().position_qk(positions, qkv, q, k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ModelConfig, backend: str) -> nn.Module:
        return Qwen3Attention(config, attention_backend=backend)
