"""Executors run the worker(s) (counterpart of `vllm/v1/executor/abstract.py`
and `uniproc_executor.py`).

The engine talks to an executor, never to a worker: here one worker in this
process; `multiproc_executor.MultiprocExecutor` (tensor_parallel_size > 1)
starts one worker per rank and broadcasts each SchedulerOutput to all of
them, since the runner learns everything from that object alone.
"""
from __future__ import annotations

from mini_vllm.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config) -> None:
        self.worker = Worker(config)
        self.model_config = self.worker.model_config
        self.max_model_len = self.worker.max_model_len

    def determine_num_blocks(self, max_num_batched_tokens: int) -> tuple[int, int]:
        return self.worker.determine_num_blocks(max_num_batched_tokens)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, max_num_seqs: int) -> None:
        self.worker.initialize_cache(num_gpu_blocks, num_cpu_blocks, max_num_seqs)

    def execute_model(self, scheduler_output):
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method, *args) -> list:
        """`Worker.method(*args)`, or fn(worker, *args): one result per rank (one rank here)."""
        fn = getattr(self.worker, method) if isinstance(method, str) else method
        return [fn(*args) if isinstance(method, str) else fn(self.worker, *args)]

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives in this process."""
