"""`FusedMoE`: every expert of one mixture-of-experts layer, stacked, plus routing.

vLLM counterpart: `vllm/model_executor/layers/fused_moe/layer.py` (`FusedMoE`,
its `weight_loader` and `make_expert_params_mapping`), with the routing of
`fused_moe/router/` (`router.py` here: softmax, top-k, optional renormalisation).

Parameters (vLLM's names and shapes), E_local experts on this rank:
* `w13_weight` [E_local, 2 * I_local, H]: each expert's gate rows, then its up rows;
* `w2_weight` [E_local, H, I_local]: each expert's down projection.

Parallelism over the tensor-parallel group the layer was built under (read
once in `__init__`, like every linear layer):
* tensor parallel (the default with tp > 1, vLLM's too): every rank holds all
  E experts, each cut to I/tp intermediate columns (gate/up rows
  [r*I/tp, (r+1)*I/tp), down columns the same); E_local = E, I_local = I/tp;
* expert parallel (`enable_expert_parallel=True`, vLLM's flag): rank r holds
  the whole experts [r*E/ep, (r+1)*E/ep) with ep = tp (vLLM's linear
  placement); `expert_map` maps a global expert id to its local index, -1
  where another rank holds it, so a rank adds only its experts' terms;
  E_local = E/ep, I_local = I.
Either way each rank's output is a partial sum and one all-reduce completes it;
with one rank there is no collective and no expert_map.

Invariants:
* routing happens on every rank from the same replicated router logits, so
  all ranks agree on every token's experts and weights;
* each checkpoint tensor lands in exactly one slice: per expert
  (`experts.{e}.gate_proj/up_proj/down_proj.weight`, Hugging Face's files) or
  fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I], the
  layout transformers 5 holds in memory); an expert this rank does not hold is
  skipped; a wrong shape is a ValueError naming both shapes;
* a size that does not split over the ranks is a ValueError naming it.
"""
from __future__ import annotations

import torch
from torch import nn

from mini_vllm.distributed import get_tp_group, tensor_model_parallel_all_reduce

from ..layers import narrow_weight, weight_shape
from . import dispatch
from .router import fused_topk

# shard ids of the weight loader: per expert (expert id, part), fused (FUSED, part)
GATE, UP, DOWN, GATE_UP = "w1", "w3", "w2", "w13"
FUSED = "all"


def _split(total: int, parts: int, what: str, how: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({parts}) {how}")
    return total // parts


class FusedMoE(nn.Module):
    """Experts of one layer; forward(hidden [T, H], router_logits [T, E]) -> [T, H]."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, enable_expert_parallel: bool = False):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.tp = get_tp_group()
        self.global_num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.use_ep = enable_expert_parallel and self.tp.world_size > 1
        size, rank = self.tp.world_size, self.tp.rank
        if self.use_ep:
            self.local_num_experts = _split(num_experts, size, "num_experts", "with expert parallelism")
            self.expert_offset, self.intermediate_size_per_partition = rank * self.local_num_experts, intermediate_size
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.expert_offset:self.expert_offset + self.local_num_experts] = torch.arange(
                self.local_num_experts, dtype=torch.int32)
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            self.local_num_experts, self.expert_offset = num_experts, 0
            self.intermediate_size_per_partition = _split(intermediate_size, size, "moe_intermediate_size",
                                                          "(experts split by columns; or enable expert parallelism)")
            self.register_buffer("expert_map", None, persistent=False)
        e, i = self.local_num_experts, self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i))
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    def checkpoint_layouts(self, prefix: str) -> list[dict[str, tuple[str, tuple]]]:
        """The two ways a checkpoint may store this layer's experts, each a map
        checkpoint tensor name -> (parameter name, shard id); a checkpoint must
        hold one of them whole. `prefix` is this module's name in the model."""
        w13, w2 = f"{prefix}.w13_weight", f"{prefix}.w2_weight"
        per_expert = {}
        for e in range(self.global_num_experts):
            per_expert[f"{prefix}.{e}.gate_proj.weight"] = (w13, (e, GATE))
            per_expert[f"{prefix}.{e}.up_proj.weight"] = (w13, (e, UP))
            per_expert[f"{prefix}.{e}.down_proj.weight"] = (w2, (e, DOWN))
        fused = {f"{prefix}.gate_up_proj": (w13, (FUSED, GATE_UP)), f"{prefix}.down_proj": (w2, (FUSED, DOWN))}
        return [per_expert, fused]

    def local_expert(self, expert_id: int) -> int | None:
        """This rank's index of global expert `expert_id`, None where another rank holds it."""
        local = expert_id - self.expert_offset
        return local if 0 <= local < self.local_num_experts else None

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: tuple) -> None:
        expert, part = shard_id
        h, i_full, i = self.hidden_size, self.intermediate_size, self.intermediate_size_per_partition
        col0 = 0 if self.use_ep else self.tp.rank * i  # this rank's intermediate columns
        if expert == FUSED:
            e_full = self.global_num_experts
            want = (e_full, 2 * i_full, h) if part == GATE_UP else (e_full, h, i_full)
            if weight_shape(loaded) != want:
                raise ValueError(f"shape mismatch for fused experts {part!r}: checkpoint tensor has shape "
                                 f"{weight_shape(loaded)}, the model expects {want}")
            mine = narrow_weight(loaded, 0, self.expert_offset, self.local_num_experts)
            with torch.no_grad():
                if part == DOWN:
                    param.copy_(mine[:, :, col0:col0 + i])
                else:
                    param[:, :i].copy_(mine[:, col0:col0 + i])
                    param[:, i:].copy_(mine[:, i_full + col0:i_full + col0 + i])
            return
        want = (h, i_full) if part == DOWN else (i_full, h)
        if weight_shape(loaded) != want:
            raise ValueError(f"shape mismatch for expert {expert} {part!r}: checkpoint tensor has shape "
                             f"{weight_shape(loaded)}, the model expects {want}")
        local = self.local_expert(expert)
        if local is None:
            return  # another rank's expert: its bytes are never read here
        with torch.no_grad():
            if part == DOWN:
                param[local].copy_(narrow_weight(loaded, 1, col0, i))
            else:
                rows = 0 if part == GATE else i  # gate rows first, then up rows
                param[local, rows:rows + i].copy_(narrow_weight(loaded, 0, col0, i))

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] float32, topk_ids [T, k] int32 global expert ids)."""
        return fused_topk(router_logits, self.top_k, self.renormalize)

    def apply(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """This rank's partial output (its experts, or its columns of every expert); no collective."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [num_tokens, hidden_size={self.hidden_size}], "
                             f"got {tuple(hidden.shape)}")
        if router_logits.shape != (hidden.shape[0], self.global_num_experts):
            raise ValueError(f"router_logits must be [num_tokens={hidden.shape[0]}, num_experts="
                             f"{self.global_num_experts}], got {tuple(router_logits.shape)}")
        topk_weights, topk_ids = self.select_experts(router_logits)
        # the Triton kernel on CUDA, the CPU path, or the reference (dispatch.py decides)
        return dispatch.fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                      expert_map=self.expert_map)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = self.apply(hidden, router_logits)
        if self.tp.world_size > 1:  # the ranks' partial sums add up to the whole layer
            out = tensor_model_parallel_all_reduce(out, self.tp)
        return out
