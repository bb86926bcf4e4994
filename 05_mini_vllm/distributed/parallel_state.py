"""Who am I among the tensor-parallel ranks, and which group do I talk through.

vLLM counterpart: `vllm/distributed/parallel_state.py` (`GroupCoordinator`,
`init_distributed_environment`, `initialize_model_parallel`,
`get_tensor_model_parallel_rank` / `_world_size`, `get_tp_group`).

Here the whole world is one tensor-parallel group (no pipeline parallelism).

Invariants:
* a layer reads `get_tp_group()` once, in `__init__`, and keeps it: its shard
  shape and its collectives always agree, even if the global group changes
  later (tests build a TP = 1 engine in a process that once held a TP group);
* outside `use_tp_group(...)`, `get_tp_group()` is a one-rank coordinator
  whose collectives are the identity, so TP = 1 never touches
  `torch.distributed`; `init_distributed_environment` returns the group and
  never installs it globally (a draft model built later stays whole);
* `verify_tensor_parallel_size` rejects a size the model cannot split (heads,
  kv heads, MLP width) with a ValueError before any process starts;
* the backend is NCCL for CUDA tensors and gloo for CPU tensors, chosen from
  the device; Python objects (a SchedulerOutput) always travel over a gloo
  group (`cpu_group`), as vLLM does, so the broadcast needs no GPU copy.
"""
from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """Exact division; a remainder is a ValueError naming `what`."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by tensor_parallel_size "
                         f"({denominator})")
    return numerator // denominator


@dataclass
class GroupCoordinator:
    """One tensor-parallel group as seen from one rank."""

    rank: int = 0
    world_size: int = 1
    device_group: object = None  # ProcessGroup for tensors (nccl or gloo); None for one rank
    cpu_group: object = None     # gloo ProcessGroup for pickled objects

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0


_SINGLE = GroupCoordinator()
_TP: GroupCoordinator = _SINGLE


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


@contextmanager
def use_tp_group(group: GroupCoordinator | None):
    """Build layers under `group` (None: one rank), restoring the previous one after."""
    global _TP
    prev, _TP = _TP, (group or _SINGLE)
    try:
        yield _TP
    finally:
        _TP = prev


TORCHRUN_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def verify_tensor_parallel_size(model_config, tp: int, enable_expert_parallel: bool = False) -> None:
    """ValueError unless the model's heads and columns split evenly over `tp` ranks;
    a mixture of experts splits its experts (expert parallelism) or each expert's columns."""
    mc = model_config
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    h, k = mc.num_attention_heads, mc.num_key_value_heads
    if tp > h:
        raise ValueError(f"tensor_parallel_size ({tp}) must be <= num_attention_heads ({h}): "
                         "every rank needs at least one attention head")
    if h % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide num_attention_heads ({h})")
    if (tp % k) if tp >= k else (k % tp):
        raise ValueError(f"tensor_parallel_size ({tp}) and num_key_value_heads ({k}) must divide "
                         "one another (kv heads are split, or replicated when tp > kv heads)")
    if mc.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide intermediate_size "
                         f"({mc.intermediate_size})")
    experts = mc.num_experts  # 0: a dense model
    if experts and enable_expert_parallel and experts % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide num_experts ({experts}) with "
                         "enable_expert_parallel: each rank holds num_experts / tp whole experts")
    if experts and not enable_expert_parallel and mc.moe_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide moe_intermediate_size "
                         f"({mc.moe_intermediate_size}), or set enable_expert_parallel")


def torchrun_env() -> dict | None:
    """MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE when all four are set (a multi-machine run)."""
    if all(k in os.environ for k in TORCHRUN_ENV_KEYS):
        return {k: os.environ[k] for k in TORCHRUN_ENV_KEYS}
    return None


def backend_for(device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed_environment(world_size: int, rank: int, init_method: str | None = None,
                                 device="cpu", timeout_s: float = 60.0,
                                 store=None) -> GroupCoordinator:
    """Join the world (this process is `rank` of `world_size`); returns its TP group.

    `init_method` is "tcp://host:port" (the rendezvous, rank 0 listens) or
    "env://" for torchrun-style MASTER_ADDR / MASTER_PORT; or pass a connected
    `store` (a `torch.distributed.TCPStore`) instead. `timeout_s` bounds
    every collective, so a peer that vanished without closing its socket still
    ends in an error instead of a hang.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; "
                           "shut the other tensor-parallel engine down first")
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = backend_for(device)
    if store is not None:
        dist.init_process_group(backend, store=store, world_size=world_size, rank=rank,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=init_method, world_size=world_size,
                                rank=rank, timeout=timeout)
    device_group = dist.group.WORLD
    cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    # Returned, not made global: a Worker builds its model inside `use_tp_group`,
    # so a draft model or a second engine in this process stays unsharded.
    return GroupCoordinator(rank, world_size, device_group, cpu_group)


def destroy_distributed_environment() -> None:
    """Leave the group (closes its sockets and the rendezvous port)."""
    if dist.is_initialized():
        dist.destroy_process_group()
