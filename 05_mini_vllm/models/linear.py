"""Linear layers shaped like vLLM's tensor-parallel ones.

vLLM counterpart: `vllm/model_executor/layers/linear.py` (`ReplicatedLinear`,
`ColumnParallelLinear`, `RowParallelLinear`, `QKVParallelLinear`, `MergedColumnParallelLinear`).

Why merged layers: one [q|k|v] matmul and one [gate|up] matmul per layer
instead of three and two. Hugging Face checkpoints store the parts separately,
so each merged parameter has a `weight_loader(param, loaded_weight, shard_id)`
that copies one part into its row range.

Tensor parallelism (Megatron style), over the group the layer was built under
(`mini_vllm.distributed.get_tp_group()`, read once in `__init__`):
* column-parallel: each rank holds output rows [rank*n/tp, (rank+1)*n/tp) and
  computes its slice of the output; no communication;
* row-parallel: each rank holds input columns [rank*k/tp, ...), multiplies its
  slice of the input and the ranks all-reduce (sum) the partial outputs; the
  bias is added once, after the sum;
* QKV splits by heads: rank r holds q heads [r*H/tp, ...) and the kv heads
  they attend to; with tp > num_kv_heads each kv head is replicated on
  tp/num_kv_heads consecutive ranks (vLLM's rule).

Invariants:
* weight is [output_size_per_partition, input_size_per_partition] (the
  `F.linear` layout), bias [output_size_per_partition];
* QKV rows are [q: num_heads*head_dim | k: num_kv_heads*head_dim | v: same]
  with this rank's head counts; gate_up rows are [gate | up], each I/tp;
* a loader never copies a tensor whose shape differs from its target slice:
  it raises ValueError with both shapes;
* with tp = 1 every layer computes exactly what it did before (same calls);
* 8-bit weights (`quantization/`): a layer whose class is `quantizable` (the column- and
  row-parallel ones, not the MoE router) built inside `use_quant_config` takes its
  `quant_method` from that config; the method may swap `weight` for an fp8 / int8 one and set
  `weight_scale` (None otherwise), and every forward pass goes through `quant_method.apply`.
"""
from __future__ import annotations

import torch
from torch import nn

from mini_vllm.distributed import divide, get_tp_group, tensor_model_parallel_all_reduce

from . import cpu_ops
from .layers import default_weight_loader, narrow_weight, weight_shape
from .quantization import UnquantizedLinearMethod, get_current_quant_config


def _check_shard(shard_id, loaded, expected: tuple[int, ...]) -> None:
    if weight_shape(loaded) != expected:
        raise ValueError(f"shape mismatch for shard {shard_id!r}: checkpoint tensor has shape "
                         f"{weight_shape(loaded)}, the model expects {expected}")


def _copy_rows(param, loaded, start: int, size: int, src_start: int, shard_id, full: int) -> None:
    """param rows [start, start+size) <- checkpoint rows [src_start, ...) of a part `full` rows long."""
    target = param.data.narrow(0, start, size)
    _check_shard(shard_id, loaded, (full,) + tuple(target.shape[1:]))
    with torch.no_grad():
        target.copy_(narrow_weight(loaded, 0, src_start, size))


class LinearBase(nn.Module):
    quantizable = False  # may a quantization config replace this layer's method (vLLM: quant_config=None)

    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp = get_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.world_size
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        # (key, packed weight: C++ bf16 panels or oneDNN), made by `cpu_ops.linear` on the first CPU call; the
        # name by which a compiled graph's packed matmul finds this layer.
        self._packed: tuple | None = None
        self._packed_name: str = cpu_ops.register_owner(self)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.register_parameter("weight_scale", None)  # an 8-bit method's per-row scales
        config = get_current_quant_config()
        self.quant_method = (config.get_quant_method(self) if config is not None and self.quantizable
                             else UnquantizedLinearMethod())
        self.quant_method.create_weights(self)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight)

    def shard_rows(self, shard_id) -> tuple[int, int]:
        """(first row, rows) of checkpoint part `shard_id` in this rank's weight (None: all of it);
        an 8-bit method's `weight_scale` loader puts each part's scales there."""
        if shard_id is None:
            return 0, self.weight.shape[0]
        raise ValueError(f"{type(self).__name__} has no part {shard_id!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)  # unquantized: cpu_ops.linear, F.linear off the CPU


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank, no communication (vLLM's `ReplicatedLinear`):
    a mixture of experts' router, whose logits every rank needs whole."""


class ColumnParallelLinear(LinearBase):
    """Splits output features across ranks: weight rows [rank*n/tp, (rank+1)*n/tp)."""
    quantizable = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = get_tp_group().world_size
        self.output_size_per_partition = divide(output_size, tp, "output_size")
        super().__init__(input_size, self.output_size_per_partition, bias)
        self.total_output_size = output_size

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if self.tp_size == 1:
            return default_weight_loader(param, loaded_weight)
        n = self.output_size_per_partition
        _copy_rows(param, loaded_weight, 0, n, self.tp_rank * n, shard_id, self.total_output_size)


class RowParallelLinear(LinearBase):
    """Splits input features across ranks; the partial outputs are all-reduced."""
    quantizable = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = get_tp_group().world_size
        self.input_size_per_partition = divide(input_size, tp, "input_size")
        super().__init__(self.input_size_per_partition, output_size, bias)
        self.total_input_size = input_size

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if self.tp_size == 1 or param is self.bias:  # the bias is whole on every rank
            return default_weight_loader(param, loaded_weight)
        k = self.input_size_per_partition
        expected = (self.output_size, self.total_input_size)
        if weight_shape(loaded_weight) != expected:
            raise ValueError(f"shape mismatch: checkpoint tensor has shape "
                             f"{weight_shape(loaded_weight)}, the model expects {expected}")
        with torch.no_grad():
            param.copy_(narrow_weight(loaded_weight, 1, self.tp_rank * k, k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        out = tensor_model_parallel_all_reduce(self.quant_method.apply(self, x, None), self.tp)
        return out if self.bias is None else out + self.bias  # bias once, after the sum


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked; shard_id is the part's index.
    Each part is split on its own, so rank r holds [gate_r | up_r]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        tp = get_tp_group().world_size
        self.output_sizes = [divide(s, tp, "intermediate_size") for s in output_sizes]
        self.total_output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is None:  # an already-merged checkpoint tensor
            if self.tp_size == 1:
                return default_weight_loader(param, loaded_weight)
            _check_shard(None, loaded_weight,
                         (sum(self.total_output_sizes),) + tuple(param.shape[1:]))
            src = 0
            for i, (n, full) in enumerate(zip(self.output_sizes, self.total_output_sizes)):
                part = narrow_weight(loaded_weight, 0, src, full)
                self.weight_loader(param, part, i)
                src += full
            return
        n, full = self.output_sizes[shard_id], self.total_output_sizes[shard_id]
        _copy_rows(param, loaded_weight, sum(self.output_sizes[:shard_id]), n,
                   self.tp_rank * n, shard_id, full)

    def shard_rows(self, shard_id) -> tuple[int, int]:
        if shard_id is None:
            return super().shard_rows(None)
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """[q | k | v] projection; shard_id is "q", "k" or "v".

    `num_heads` / `num_kv_heads` are this rank's counts; `total_*` the model's."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        tp = get_tp_group().world_size
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        if tp >= total_num_kv_heads:  # replicate: each kv head on tp/K ranks
            if tp % total_num_kv_heads:
                raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of "
                                 f"num_key_value_heads ({total_num_kv_heads}) when it exceeds it")
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        q, kv = self.num_heads * head_size, self.num_kv_heads * head_size
        self.shard_ranges = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        tq, tkv = total_num_heads * head_size, total_num_kv_heads * head_size
        self.total_shard_ranges = {"q": (0, tq), "k": (tq, tkv), "v": (tq + tkv, tkv)}
        # the column split is by heads, not by rows of the merged matrix
        super().__init__(hidden_size, (q + 2 * kv) * tp, bias)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is None:
            if self.tp_size == 1:
                return default_weight_loader(param, loaded_weight)
            tq, tkv = self.total_shard_ranges["q"][1], self.total_shard_ranges["k"][1]
            _check_shard(None, loaded_weight, (tq + 2 * tkv,) + tuple(param.shape[1:]))
            for sid in ("q", "k", "v"):
                src, full = self.total_shard_ranges[sid]
                self.weight_loader(param, narrow_weight(loaded_weight, 0, src, full), sid)
            return
        start, size = self.shard_ranges[shard_id]
        if shard_id == "q":
            head0 = self.tp_rank * self.num_heads
        else:
            head0 = (self.tp_rank // self.num_kv_head_replicas) * self.num_kv_heads
        _copy_rows(param, loaded_weight, start, size, head0 * self.head_size, shard_id,
                   self.total_shard_ranges[shard_id][1])

    def shard_rows(self, shard_id) -> tuple[int, int]:
        return super().shard_rows(None) if shard_id is None else self.shard_ranges[shard_id]
