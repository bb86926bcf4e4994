"""Executors (vLLM: `vllm/v1/executor/`): `abstract.Executor` is the interface the
engine core uses; `uniproc_executor` runs one worker in this process,
`multiproc_executor` one worker per tensor-parallel rank."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for the annotation: the config module imports the attention backends
    from mini_vllm.config import EngineConfig


def get_executor_class(config: EngineConfig):
    """One rank in this process, or one worker process per tensor-parallel rank
    (vLLM's `Executor.get_class` picks by `distributed_executor_backend`; here
    the rank count decides). Imported on demand: the tensor-parallel executor
    pulls in torch.distributed, which a one-rank engine never needs."""
    if config.tensor_parallel_size > 1:
        from mini_vllm.executor.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor
    from mini_vllm.executor.uniproc_executor import UniProcExecutor
    return UniProcExecutor
