"""The engine core: scheduler + executor, one step at a time.

vLLM counterpart: `vllm/v1/engine/core.py` (`EngineCore.step`,
`step_with_batch_queue`, `add_request`, `abort_requests`). vLLM keeps
`EngineCoreProc` in the same file; here it is `core_proc.py`, to keep each
file one concept.

`EngineCore` is the step, readable end to end:

    schedule() -> execute_model(scheduler_output) -> update_from_output()

With asynchronous scheduling, `step_with_batch_queue` schedules the next
batch before the previous one is back (two in flight; placeholders for the
tokens in flight, see Chapter 3's `Request.num_output_placeholders`).

Invariants: after `abort_requests` or a finished request, its KV blocks are
back in the pool before the next `schedule()`; under asynchronous scheduling a
request never has more output placeholders than batches in flight.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from pathlib import Path

from mini_vllm.engine import EngineCoreOutputs, EngineCoreReady, EngineCoreRequest
from mini_vllm.executor import get_executor_class
from mini_vllm.executor.abstract import Executor
from mini_vllm.metrics.stats import SchedulerStats, SpecDecodingStats
from mini_vllm.models.config import ModelConfig
from mini_vllm.scheduler import Request, RequestStatus, Scheduler
from mini_vllm.spec_decode.engine.verifier import spec_eligible
from mini_vllm.worker.async_output import DeferredStepOutput

logger = logging.getLogger("mini_vllm")

# What a client may call by name in the core (vLLM's utility calls): read-only
# views and the stats the front end cannot compute itself.
UTILITY_METHODS = frozenset({"spec_decoding_stats", "make_stats", "has_unfinished_requests",
                             "num_free_blocks", "num_free_cpu_blocks", "reset_prefix_cache"})


class EngineCore:
    """`executor_class` (vLLM's argument of the same name) defaults to the one
    the config asks for (`get_executor_class`); tools pass a subclass to watch
    or shape execution (Chapter 6's P/D engine process counts the tokens it
    computes this way)."""

    def __init__(self, config, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        # Chapter 6, imported only when asked for: the scheduler-side connector stays
        # here, its worker-side twin (same store, same counters) goes to the executor.
        self.kv_connector = self.kv_connector_worker = None
        if config.kv_transfer_config is not None:
            from mini_vllm.global_cache.factory import build_connectors
            model_config = ModelConfig.from_json(Path(config.model) / "config.json")
            self.kv_connector, self.kv_connector_worker = build_connectors(config, model_config)
        executor_class = executor_class or get_executor_class(config)
        self.executor = executor_class(config, kv_connector=self.kv_connector_worker)
        self.model_config = self.executor.model_config
        self.max_model_len = self.executor.max_model_len
        budget_probe = config.scheduler_config(self.max_model_len, 0)
        n_gpu, n_cpu = self.executor.determine_num_blocks(budget_probe.max_num_batched_tokens)
        self.num_gpu_blocks, self.num_cpu_blocks = n_gpu, n_cpu
        self.executor.initialize_cache(n_gpu, n_cpu, config.max_num_seqs)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB), swap space: %d blocks", n_gpu,
                    config.block_size, n_gpu * self.executor.bytes_per_block / 2**20, n_cpu)
        self.scheduler = Scheduler(config.scheduler_config(self.max_model_len, n_cpu), n_gpu,
                                   config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                   connector=self.kv_connector)
        # Asynchronous scheduling: (future, SchedulerOutput, two timestamps) of the
        # batches submitted and not yet updated from; None when every step is synchronous.
        self.batch_queue: collections.deque | None = collections.deque() if config.async_scheduling else None
        self.batch_queue_size = 2

    def ready_info(self) -> EngineCoreReady:
        """The facts the front end validates requests against (the handshake)."""
        return EngineCoreReady(self.max_model_len, self.num_gpu_blocks, self.num_cpu_blocks,
                               self.config.block_size, os.getpid())

    def add_request(self, request: EngineCoreRequest) -> None:
        """Turn the front end's validated request into the scheduler's `Request`
        (vLLM's `EngineCore.add_request` after `preprocess_add_request`)."""
        spec = self.config.speculative_config is not None and spec_eligible(request.sampling_params)
        self.scheduler.add_request(Request(
            request.request_id, request.prompt_token_ids, request.sampling_params,
            eos_token_id=request.eos_token_id, arrival_time=request.arrival_time,
            priority=request.priority, cache_salt=request.cache_salt, spec_decode=spec))

    def abort_requests(self, request_ids) -> None:
        """Finish requests decided outside the scheduler (vLLM's `abort_requests`):
        the client's aborts, and the stop strings the front end's detokenizer
        found. Their blocks are free before the next `schedule()`. Stop tokens,
        max_tokens and the length limit never come here: the scheduler decides
        those itself in `update_from_output`. Unknown ids are ignored (the
        request may have finished meanwhile)."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.num_free_blocks

    def num_free_cpu_blocks(self) -> int:
        return self.scheduler.cpu_block_pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the executor's worker processes (none with one rank)."""
        self.executor.shutdown_step_thread()
        self.executor.shutdown()

    def step(self) -> EngineCoreOutputs:
        """One synchronous step: schedule, execute, update; the next step is
        scheduled only once this one's tokens are known."""
        t0 = time.monotonic()
        so = self._schedule()
        t1 = time.monotonic()
        mro = self.executor.execute_model(so)
        return self._update(so, mro, {"start": t0, "scheduled": t1, "executed": time.monotonic()})

    def step_with_batch_queue(self) -> EngineCoreOutputs | None:
        """One step of asynchronous scheduling (vLLM's `step_with_batch_queue`).

        While the queue has room, schedule the next batch and submit it without
        waiting: its running requests compute the position of the token still in
        flight (a placeholder). When the queue is full (two batches: one runs, the
        next waits behind it), wait for the oldest and update from it. Returns
        None when it only scheduled, so that the busy loop can take the
        messages that arrived before it schedules again."""
        q = self.batch_queue
        if len(q) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            t0 = time.monotonic()
            so = self._schedule()
            # Submitted even when empty: its finished_req_ids are the runner's only
            # word to free those rows, so dropping it leaves stale rows behind that
            # overflow the persistent batch once max_num_seqs new requests arrive.
            q.append((self.executor.execute_model_async(so), so, t0, time.monotonic()))
            if len(q) < self.batch_queue_size and so.total_num_scheduled_tokens > 0:
                return None
        if not q:
            return None
        fut, so, t0, t1 = q.popleft()
        mro, t_exec, t2 = fut.result()  # a step that raised raises here: the engine is dead
        if isinstance(mro, DeferredStepOutput):  # the step thread may already run the next step
            mro, t2 = mro.get_output(), time.monotonic()  # waits for this step's tokens alone
        out = self._update(so, mro, {"start": t0, "scheduled": t1, "execute_start": t_exec, "executed": t2})
        self._check_placeholders()
        return out

    def _check_placeholders(self) -> None:
        """Each placeholder is a token of a batch still in the queue (a sampled token, or
        a draft that may be accepted): a request can never have more than 1 + k per
        queued batch that scheduled it (an empty batch, queued only for the
        finished_req_ids it carries, holds none). Fails fast (the engine dies with this
        message) instead of scheduling positions whose tokens will never come."""
        per_step = 1 + self.scheduler.config.num_spec_tokens
        for req in self.scheduler.requests.values():  # preempted ones too: they wait for theirs
            steps = sum(req.request_id in so.num_scheduled_tokens for _, so, *_ in self.batch_queue)
            if not 0 <= req.num_output_placeholders <= steps * per_step:
                raise RuntimeError(
                    f"request {req.request_id!r} has {req.num_output_placeholders} output placeholders, at most "
                    f"{steps * per_step} allowed ({steps} step(s) in flight that scheduled it, 1 + k each): a "
                    "token that came back did not replace its placeholder, or a rejected draft kept its own")

    def _schedule(self):
        return self.scheduler.schedule()

    def _update(self, so, mro, stamps: dict[str, float]) -> EngineCoreOutputs:
        outputs = self.scheduler.update_from_output(so, mro)
        if mro.spec_token_ids:  # the proposer's drafts, for the next schedule()
            self.scheduler.update_draft_token_ids(mro.spec_token_ids)
        lps = mro.logprobs or {}
        plps = mro.prompt_logprobs_dict or {}
        for o in outputs:
            if o.request_id in lps:
                o.logprobs = lps[o.request_id][:len(o.new_token_ids)]
            o.prompt_logprobs = plps.get(o.request_id)
        # Every number here was counted by its owner: the scheduler, when it decided the step.
        return EngineCoreOutputs(outputs, self.scheduler.make_stats(), first_scheduled=list(so.first_scheduled_req_ids),
                                 num_prompt_tokens_computed=so.num_prompt_tokens,
                                 timestamps={**stamps, "updated": time.monotonic()},
                                 spec_decoding_stats=make_spec_decoding_stats(so, mro))

    def spec_decoding_stats(self) -> dict | None:
        """Acceptance rate and per-position acceptance of verified drafts: the
        fields of `metrics.stats.SpecDecodingStats` as a dict, None without
        speculative decoding. Every rank verifies; rank 0's counts are the ones
        behind the tokens the engine emits."""
        stats = self.executor.collective_rpc("spec_decoding_stats")[0]
        return None if stats is None else dataclasses.asdict(stats)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()


def make_spec_decoding_stats(so, mro) -> SpecDecodingStats | None:
    """One step's verified drafts, for the stat loggers (vLLM's
    `Scheduler.make_spec_decoding_stats`, called from `update_from_output`):
    each request that was scheduled with drafts and sampled is one draft
    sequence; all its tokens but the last (the bonus or the correction) are
    accepted drafts. None for a step without drafts, so a step without
    speculation costs one empty-dict check. These are the counts the worker's
    verifier keeps since the start (`spec_decoding_stats`), learned from the
    step's own input and output, so no call reaches the workers."""
    stats = None
    for rid, drafts in so.scheduled_spec_decode_tokens.items():
        i = mro.req_id_to_index.get(rid)
        sampled = mro.sampled_token_ids[i] if i is not None else ()
        if drafts and sampled:
            if stats is None:
                stats = SpecDecodingStats()
            stats.observe_draft(len(drafts), len(sampled) - 1)
    return stats
