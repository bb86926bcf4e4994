"""Tensor parallelism on `torch.distributed` (vLLM: `vllm/distributed/`).

`parallel_state` owns the process group of the tensor-parallel ranks;
`communication_op` holds the collectives the model layers call. With one rank
(no group) every collective is the identity, so single-process code pays nothing.
"""
from .communication_op import (COMM_CALLS, COMM_STATS, broadcast_object, gather_object,
                               min_over_ranks, tensor_model_parallel_all_gather,
                               tensor_model_parallel_all_reduce)
from .parallel_state import (GroupCoordinator, destroy_distributed_environment, divide,
                             get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                             get_tp_group, init_distributed_environment, use_tp_group)

__all__ = ["COMM_CALLS", "COMM_STATS", "GroupCoordinator", "broadcast_object",
           "destroy_distributed_environment", "divide", "gather_object",
           "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_tp_group",
           "init_distributed_environment", "min_over_ranks", "tensor_model_parallel_all_gather",
           "tensor_model_parallel_all_reduce", "use_tp_group"]
