"""Rotary position embedding (RoPE), "default" and "llama3" frequency schedules.

vLLM counterpart: `vllm/model_executor/layers/rotary_embedding/`
(`RotaryEmbedding`, `Llama3RotaryEmbedding`, `get_rope`).

Invariants:
* neox layout (the Hugging Face Llama/Qwen one): the head is split into two
  halves [x1 | x2] and rotated as (x1*cos - x2*sin, x2*cos + x1*sin), with
  frequency j shared by dims j and j + head_dim/2;
* angles are computed in float32 as float(position) * inv_freq, the same
  product Hugging Face forms, then cos/sin are cast to the query's dtype;
* positions are absolute (a decode token at position p uses row p of the
  cos/sin table), so the rotation is independent of how a batch is chunked;
  positions must be < max_position (the table's length).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from mini_vllm.kernels import cpu_layer_ops

from . import cpu_ops

ROPE_TYPES = ("default", "llama3")


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (base ** exps)


def llama3_inv_freq(head_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """Llama 3.1 schedule: wavelengths longer than the original context /
    low_freq_factor are slowed by `factor`, shorter than original /
    high_freq_factor are kept, and the band in between is interpolated."""
    try:
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
    except KeyError as e:
        raise ValueError(f"rope_scaling of type 'llama3' needs the key {e.args[0]!r}, got {scaling}") from None
    inv_freq = default_inv_freq(head_dim, base)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """forward(positions [T], q [T, H*D], k [T, KVH*D]) -> rotated (q, k)."""

    def __init__(self, head_size: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        if head_size % 2:
            raise ValueError(f"head_size must be even for rotary embedding, got {head_size}")
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
        self.head_size = head_size
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(head_size, base, rope_scaling)
        else:
            inv_freq = default_inv_freq(head_size, base)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]                # [max_position, D/2]
        # fp32 table, kept out of state_dict (derived, not a checkpoint tensor).
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.view(shape)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        if cpu_ops.fused(query):  # one pass per tensor instead of about ten (kernels/cpu_layer_ops.py)
            return (cpu_layer_ops.rotary_embedding(positions, query, self.cos_cache, self.sin_cache, self.head_size),
                    cpu_layer_ops.rotary_embedding(positions, key, self.cos_cache, self.sin_cache, self.head_size))
        cos = self.cos_cache[positions].to(query.dtype)[:, None, :]  # [T, 1, D/2]
        sin = self.sin_cache[positions].to(query.dtype)[:, None, :]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)


def get_rope(head_size: int, max_position: int, base: float, rope_scaling: dict | None = None) -> RotaryEmbedding:
    return RotaryEmbedding(head_size, max_position, base, rope_scaling)
