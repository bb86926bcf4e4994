"""Llama decoder, the template Qwen2 and Qwen3 specialise.

vLLM counterpart: `vllm/model_executor/models/llama.py` (`LlamaMLP`,
`LlamaAttention`, `LlamaDecoderLayer`, `LlamaModel`, `LlamaForCausalLM`).

Invariants:
* inputs are the flattened varlen batch: input_ids and positions [T], no
  batch axis; attention finds each token's sequence through the forward context;
* parameter names equal the checkpoint's, except the merged `qkv_proj` and
  `gate_up_proj`, listed in `packed_modules_mapping` for the loader;
* the residual stream is carried beside the hidden state (vLLM's fused
  add + RMSNorm), which adds in the same order as Hugging Face's code;
* `compute_logits` returns float32 whatever the model dtype;
* tensor parallelism: attention heads and MLP columns are split across the
  ranks of the group the layers were built under (see `linear.py`); per
  layer exactly two all-reduces, after o_proj and after down_proj.
"""
from __future__ import annotations

import torch
from torch import nn

from mini_vllm.forward_context import get_forward_context

from .attention import Attention
from .cpu_step import FlatCpuForward
from .config import ModelConfig
from .layers import ParallelLMHead, RMSNorm, SiluAndMul, VocabParallelEmbedding
from .linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .rotary import get_rope


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """qkv_proj -> (per-head q/k norm, Qwen3 only) -> RoPE -> paged attention -> o_proj."""
    # The fused op by which the flat CPU step (cpu_step.py) turns qkv into rotated q and k:
    # "rope" (two rotations); Qwen3 declares "qk_norm_rope". A subclass that changes
    # position_qk otherwise must declare another name, which the flat step refuses.
    qk_kernel = "rope"

    def __init__(self, config: ModelConfig, qkv_bias: bool, o_bias: bool, attention_backend: str):
        super().__init__()
        c = config
        self.head_dim = c.head_dim
        self.qkv_proj = QKVParallelLinear(c.hidden_size, self.head_dim, c.num_attention_heads,
                                          c.num_key_value_heads, qkv_bias)
        # this rank's heads (all of them with tensor-parallel size 1)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(c.num_attention_heads * self.head_dim, c.hidden_size, bias=o_bias)
        self.rotary_emb = get_rope(self.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              attention_backend)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        return q, k  # Llama and Qwen2 have none; Qwen3 overrides

    def position_qk(self, positions: torch.Tensor, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q and k (views of qkv) normed where the model norms them, then rotated."""
        q, k = self.qk_norm(q, k)
        return self.rotary_emb(positions, q, k)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.position_qk(positions, qkv, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: nn.Module, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = attention
        # the dense MLP unless the model gives another block (a mixture of experts)
        self.mlp = mlp if mlp is not None else LlamaMLP(config.hidden_size, config.intermediate_size,
                                                        config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, make_attention, make_mlp):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, make_attention(), make_mlp(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The eager CPU step as one flat loop over prepared kernel calls (cpu_step.py): the
        # same kernels and bits as the modules below, without their per-call Python.
        self.flat_cpu = FlatCpuForward(self, LlamaAttention, LlamaMLP)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.flat_cpu.usable(input_ids):  # cheap checks first; None: this step takes the modules
            hidden = self.flat_cpu.forward(input_ids, positions, get_forward_context())
            if hidden is not None:
                return hidden
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # merged parameter -> [(checkpoint module name, shard id)], for the loader
    packed_modules_mapping = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    def __init__(self, config: ModelConfig, attention_backend: str = "torch"):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, lambda: self.make_attention(config, attention_backend),
                                lambda layer_idx: self.make_mlp(config, layer_idx))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def make_attention(self, config: ModelConfig, backend: str) -> nn.Module:
        return LlamaAttention(config, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                              attention_backend=backend)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s feed-forward block (a mixture of experts overrides it)."""
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] token ids and absolute positions -> final hidden states [T, hidden];
        call inside `set_forward_context(md)`."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
