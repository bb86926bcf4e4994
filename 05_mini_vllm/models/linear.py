"""Linear layers shaped like vLLM's tensor-parallel ones (tensor-parallel size 1).

vLLM counterpart: `vllm/model_executor/layers/linear.py` (`ColumnParallelLinear`,
`RowParallelLinear`, `QKVParallelLinear`, `MergedColumnParallelLinear`).

Why merged layers: one [q|k|v] matmul and one [gate|up] matmul per layer
instead of three and two. Hugging Face checkpoints store the parts separately,
so each merged parameter has a `weight_loader(param, loaded_weight, shard_id)`
that copies one part into its row range.

Invariants:
* weight is [output_size, input_size] (the `F.linear` layout), bias [output_size];
* QKV rows are [q: num_heads*head_dim | k: num_kv_heads*head_dim | v: same];
  gate_up rows are [gate: intermediate | up: intermediate];
* a loader never copies a tensor whose shape differs from its target slice:
  it raises ValueError with both shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import default_weight_loader


def _check_shard(shard_id, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"shape mismatch for shard {shard_id!r}: checkpoint tensor has shape "
                         f"{tuple(loaded.shape)}, the model expects {expected}")


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Splits output features across ranks (one rank here)."""


class RowParallelLinear(LinearBase):
    """Splits input features across ranks (one rank here; no all-reduce)."""


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked; shard_id is the part's index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is None:  # an already-merged checkpoint tensor
            return default_weight_loader(param, loaded_weight)
        start = sum(self.output_sizes[:shard_id])
        target = param.data.narrow(0, start, self.output_sizes[shard_id])
        _check_shard(shard_id, loaded_weight, tuple(target.shape))
        with torch.no_grad():
            target.copy_(loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """[q | k | v] projection; shard_id is "q", "k" or "v"."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        self.head_size, self.num_heads, self.num_kv_heads = head_size, total_num_heads, total_num_kv_heads
        q, kv = total_num_heads * head_size, total_num_kv_heads * head_size
        self.shard_ranges = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        super().__init__(hidden_size, q + 2 * kv, bias)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded_weight)
        start, size = self.shard_ranges[shard_id]
        target = param.data.narrow(0, start, size)
        _check_shard(shard_id, loaded_weight, tuple(target.shape))
        with torch.no_grad():
            target.copy_(loaded_weight)
