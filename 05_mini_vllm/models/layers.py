"""Small building blocks shared by every model: RMSNorm, SiluAndMul, vocab embedding, LM head.

vLLM counterparts: `vllm/model_executor/layers/layernorm.py` (`RMSNorm`),
`vllm/model_executor/layers/activation.py` (`SiluAndMul`) and
`vllm/model_executor/layers/vocab_parallel_embedding.py`
(`VocabParallelEmbedding`, `ParallelLMHead`).

Invariants:
* RMSNorm normalises in float32 and casts back to the input dtype BEFORE the
  weight multiply, exactly as Hugging Face does; the other order rounds
  differently in bf16/fp16 and drifts from the oracle.
* every parameter carries a `weight_loader(param, loaded_weight)` that checks
  the checkpoint shape before copying (see `linear.py`); `loaded_weight` is a
  tensor or a lazy safetensors slice, so a rank reads only its shard's bytes;
* vocab-parallel: rank r holds rows [r*V', (r+1)*V') of the table, V' =
  ceil(V/tp) (rows past V are zero padding); the embedding all-reduces (each
  token's row is nonzero on exactly one rank, so the sum is exact) and the LM
  head all-gathers its logit columns, then drops the padding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mini_vllm.distributed import (get_tp_group, tensor_model_parallel_all_gather,
                                   tensor_model_parallel_all_reduce)
from mini_vllm.kernels import cpu_layer_ops

from . import cpu_ops


def weight_shape(loaded) -> tuple[int, ...]:
    """Shape of a tensor or of a safetensors slice (read without loading it)."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def narrow_weight(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """`loaded[..., start:start+size, ...]` along `dim`; a safetensors slice reads only those bytes."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    index = [slice(None)] * len(weight_shape(loaded))
    index[dim] = slice(start, start + size)
    return loaded[tuple(index)]


def default_weight_loader(param: nn.Parameter, loaded_weight) -> None:
    """Copy a whole checkpoint tensor into `param` (cast to its dtype/device)."""
    if tuple(param.shape) != weight_shape(loaded_weight):
        raise ValueError(f"shape mismatch: checkpoint tensor has shape {weight_shape(loaded_weight)}, "
                         f"the model expects {tuple(param.shape)}")
    if not isinstance(loaded_weight, torch.Tensor):
        loaded_weight = loaded_weight[:]
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
        if cpu_ops.fused(x, self.weight):  # one pass instead of six (kernels/cpu_layer_ops.py)
            if residual is None:
                return cpu_layer_ops.rms_norm(x, self.weight, self.eps)
            return cpu_layer_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.fused(x):  # one pass instead of three (kernels/cpu_layer_ops.py)
            return cpu_layer_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class VocabParallelEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size], rows split across ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp.world_size)
        self.vocab_start_index = self.tp.rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition,
                                   num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        self.weight.weight_loader = self.weight_loader
        # As lm_head (`ParallelLMHead`): (key, packed weight), made by `cpu_ops.linear`,
        # and the name by which a compiled graph's packed matmul finds this layer.
        self._packed: tuple | None = None
        self._packed_name: str = cpu_ops.register_owner(self)

    def weight_loader(self, param: nn.Parameter, loaded_weight) -> None:
        if self.tp.world_size == 1:
            return default_weight_loader(param, loaded_weight)
        expected = (self.num_embeddings, param.shape[1])
        if weight_shape(loaded_weight) != expected:
            raise ValueError(f"shape mismatch: checkpoint tensor has shape "
                             f"{weight_shape(loaded_weight)}, the model expects {expected}")
        n = self.vocab_end_index - self.vocab_start_index
        with torch.no_grad():
            param.zero_()  # padding rows past the vocabulary stay zero
            param[:n].copy_(narrow_weight(loaded_weight, 0, self.vocab_start_index, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        emb = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(emb, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocab; `tie_to(embedding)` shares the
    embedding's weight (tied checkpoints store no `lm_head.weight`)."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """[T, hidden] -> [T, vocab]: full logits on every rank (gathered before sampling)."""
        logits = cpu_ops.linear(hidden, self.weight, None, self)
        if self.tp.world_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits, self.tp)[:, :self.num_embeddings]
