"""One worker in this process (vLLM: `vllm/v1/executor/uniproc_executor.py`).

The engine talks to an executor, never to a worker (see `abstract.py` for
the interface); here every call is a plain method call on the one worker.
`multiproc_executor.MultiprocExecutor` (tensor_parallel_size > 1) starts one
worker per rank and broadcasts each SchedulerOutput to all of them, since the
runner learns everything from that object alone.
"""
from __future__ import annotations

from mini_vllm.executor.abstract import Executor
from mini_vllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config, kv_connector=None) -> None:
        self.driver_worker = Worker(config, kv_connector=kv_connector)
        self.model_config = self.driver_worker.model_config
        self.max_model_len = self.driver_worker.max_model_len
        self.bytes_per_block = self.driver_worker.bytes_per_block

    def determine_num_blocks(self, max_num_batched_tokens: int) -> tuple[int, int]:
        return self.driver_worker.determine_num_blocks(max_num_batched_tokens)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, max_num_seqs: int) -> None:
        self.driver_worker.initialize_cache(num_gpu_blocks, num_cpu_blocks, max_num_seqs)

    def execute_model(self, scheduler_output):
        return self.driver_worker.execute_model(scheduler_output)

    def collective_rpc(self, method, *args) -> list:
        """`Worker.method(*args)`, or fn(worker, *args): one result per rank (one rank here)."""
        if isinstance(method, str):
            return [getattr(self.driver_worker, method)(*args)]
        return [method(self.driver_worker, *args)]

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives in this process."""
