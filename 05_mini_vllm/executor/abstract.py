"""The executor interface: the engine core's only handle on its workers.

vLLM counterpart: `vllm/v1/executor/abstract.py` (`Executor`,
`determine_available_memory`, `initialize_from_config`, `execute_model`,
`collective_rpc`, `check_health`, `shutdown`).

The engine core never touches a worker, a model runner or a KV tensor: it
asks the executor, so the same core drives one worker in this process
(`UniProcExecutor`) or one worker per tensor-parallel rank
(`MultiprocExecutor`). Everything a worker needs from outside is passed in
at construction (the engine config and, with Chapter 6, the worker-side KV
connector); the speculative proposer and the model runner are built by the
worker itself from the config.

Which implementation an engine gets is `mini_vllm.executor.get_executor_class`
(vLLM's `Executor.get_class`; kept out of this module so that the base class
never imports its subclasses, which would make an import cycle).

Invariants every implementation keeps:
* `model_config`, `max_model_len` and `bytes_per_block` are known after
  `__init__` (the model is loaded, the cache is not allocated yet);
* `determine_num_blocks` comes before `initialize_cache`, which comes before
  the first `execute_model`; every rank agrees on the block counts;
* `execute_model(scheduler_output)` returns rank 0's `ModelRunnerOutput`:
  a SchedulerOutput is all a worker learns about the batch;
* `collective_rpc(method, *args)` runs `Worker.method(*args)` (a name) or
  `fn(worker, *args)` (a function) on every rank and returns one result per
  rank, in rank order (tests and tools read worker state this way);
* `shutdown()` is idempotent.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class Executor(ABC):
    model_config: Any
    max_model_len: int
    bytes_per_block: int  # KV bytes of one block on one rank, all layers, K and V
    # One thread runs the steps of asynchronous scheduling, in submission order
    # (vLLM's `execute_model(..., non_block=True)`); created on first use.
    _step_thread: ThreadPoolExecutor | None = None

    @abstractmethod
    def __init__(self, config, kv_connector=None) -> None:
        """Start the worker(s) and load the model; `kv_connector` is the
        worker-side Chapter 6 connector, or None."""

    @abstractmethod
    def determine_num_blocks(self, max_num_batched_tokens: int) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) the KV budget allows, the same on every rank."""

    @abstractmethod
    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, max_num_seqs: int) -> None:
        """Allocate the KV cache and build the model runner on every rank."""

    @abstractmethod
    def execute_model(self, scheduler_output):
        """One forward pass of the scheduled batch; rank 0's ModelRunnerOutput."""

    @abstractmethod
    def collective_rpc(self, method: str | Callable, *args) -> list:
        """Run a Worker method (by name) or fn(worker, *args) on every rank; results in rank order."""

    def execute_model_async(self, scheduler_output) -> Future:
        """Start one forward pass and return at once; the future gives
        (ModelRunnerOutput, start, end) with time.monotonic() stamps. Steps run
        one after the other in submission order, so a step always sees the
        KV cache and runner state its predecessors left."""
        if self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="execute_model")

        def run():
            t0 = time.monotonic()
            out = self.execute_model(scheduler_output)
            return out, t0, time.monotonic()

        return self._step_thread.submit(run)

    def shutdown_step_thread(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None

    def check_health(self) -> None:
        """Raise if a worker is gone (nothing can fail with one in-process rank)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers; idempotent."""
