"""Small building blocks shared by every model: RMSNorm, SiluAndMul, vocab embedding, LM head.

vLLM counterparts: `vllm/model_executor/layers/layernorm.py` (`RMSNorm`),
`vllm/model_executor/layers/activation.py` (`SiluAndMul`) and
`vllm/model_executor/layers/vocab_parallel_embedding.py`
(`VocabParallelEmbedding`, `ParallelLMHead`), here with tensor-parallel size 1.

Invariants:
* RMSNorm normalises in float32 and casts back to the input dtype BEFORE the
  weight multiply, exactly as Hugging Face does; the other order rounds
  differently in bf16/fp16 and drifts from the oracle.
* every parameter carries a `weight_loader(param, loaded_weight)` that checks
  the checkpoint shape before copying (see `linear.py`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into `param` (cast to its dtype/device)."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(f"shape mismatch: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                         f"the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded_weight)


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); `forward(x, residual)` first
    adds the residual and returns (normed, new_residual), like vLLM's fused op."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)  # cast first, then scale (HF order)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class VocabParallelEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocab; `tie_to(embedding)` shares the
    embedding's weight (tied checkpoints store no `lm_head.weight`)."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.linear(hidden, self.weight)
