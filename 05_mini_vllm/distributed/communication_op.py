"""The collectives the tensor-parallel layers call.

vLLM counterpart: `vllm/distributed/communication_op.py`
(`tensor_model_parallel_all_reduce`, `tensor_model_parallel_all_gather`) and
`GroupCoordinator.broadcast_object` in `parallel_state.py`.

Invariants: every function takes the group explicitly (a layer passes the
group it was built under); with a one-rank group each is the identity and
returns its input unchanged, without calling `torch.distributed`. Byte
counters (`COMM_STATS`) record what each rank sent, for the chapter's
bytes-per-token measurement; `COMM_CALLS` counts the calls.
"""
from __future__ import annotations

import pickle
from collections import Counter

import torch
import torch.distributed as dist

from .parallel_state import GroupCoordinator

# op name -> payload bytes this rank contributed (tensor bytes, not wire bytes)
COMM_STATS: Counter = Counter()
# op name -> number of calls
COMM_CALLS: Counter = Counter()


def tensor_model_parallel_all_reduce(x: torch.Tensor, group: GroupCoordinator) -> torch.Tensor:
    """Sum of `x` over the ranks (in place on a contiguous copy)."""
    if group.world_size == 1:
        return x
    x = x.contiguous()
    COMM_STATS["all_reduce"] += x.numel() * x.element_size()
    COMM_CALLS["all_reduce"] += 1
    dist.all_reduce(x, group=group.device_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, group: GroupCoordinator,
                                     dim: int = -1) -> torch.Tensor:
    """Concatenation of every rank's `x` along `dim`, in rank order."""
    if group.world_size == 1:
        return x
    x = x.contiguous()
    COMM_STATS["all_gather"] += x.numel() * x.element_size()
    COMM_CALLS["all_gather"] += 1
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    dist.all_gather(parts, x, group=group.device_group)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj, group: GroupCoordinator, src: int = 0):
    """Rank `src` sends `obj` (pickled once); every rank returns the same object."""
    if group.world_size == 1:
        return obj
    if group.rank == src:
        COMM_STATS["broadcast_object"] += len(pickle.dumps(obj))
        COMM_CALLS["broadcast_object"] += 1
    box = [obj if group.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=group.cpu_group)
    return box[0]


def min_over_ranks(value: int, group: GroupCoordinator) -> int:
    """The smallest `value` any rank holds (every rank must size its KV cache alike)."""
    if group.world_size == 1:
        return value
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(t.item())


def gather_object(obj, group: GroupCoordinator, dst: int = 0):
    """Every rank's `obj`, in rank order, on rank `dst` (None elsewhere)."""
    if group.world_size == 1:
        return [obj]
    out = [None] * group.world_size if group.rank == dst else None
    dist.gather_object(obj, out, dst=dst, group=group.cpu_group)
    return out
