"""Executors run the worker(s) (counterpart of `vllm/v1/executor/abstract.py`
and `uniproc_executor.py`).

The engine talks to an executor, never to a worker: today one worker in this
process; a tensor-parallel executor would start one worker per rank and
broadcast each SchedulerOutput to all of them, since the runner learns
everything from that object alone.
"""
from __future__ import annotations

from mini_vllm.worker import Worker


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
