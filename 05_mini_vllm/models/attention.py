"""The `Attention` layer every model calls: paged KV cache + a chosen backend.

vLLM counterpart: `vllm/attention/layer.py` (`Attention`), which binds the
layer's slice of the KV cache (`self.kv_cache`) and forwards to the backend
picked by `vllm/attention/selector.py`.

Invariants:
* the runner binds `self.kv_cache = (key_cache, value_cache)`, each
  [num_blocks, block_size, num_kv_heads, head_size], before the first forward;
* the batch layout comes from `get_forward_context()`, never from arguments,
  so model code keeps Hugging Face's shape;
* `forward` takes and returns flat [T, heads*head_size] rows; the backend
  writes this step's K/V into the cache before it reads anything.
"""
from __future__ import annotations

import torch
from torch import nn

from mini_vllm.attention.backends import get_attn_backend
from mini_vllm.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 attention_backend: str = "torch"):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.set_backend(attention_backend)

    def set_backend(self, name: str) -> None:
        self.backend = get_attn_backend(name)
        self.backend_name = name

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = get_forward_context()
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not bound: the runner must set "
                               "layer.kv_cache = (key_cache, value_cache) before the first forward")
        num_tokens = q.shape[0]
        out = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_size),
            k.view(num_tokens, self.num_kv_heads, self.head_size),
            v.view(num_tokens, self.num_kv_heads, self.head_size),
            self.kv_cache[0], self.kv_cache[1], md, self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_size)


def set_attention_backend(model: nn.Module, name: str) -> None:
    """Switch every `Attention` layer of `model` to the backend `name`."""
    get_attn_backend(name)  # validates the name once, before touching any layer
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_backend(name)
