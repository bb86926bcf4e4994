"""The engine core: scheduler + executor, one step at a time.

vLLM counterpart: `vllm/v1/engine/core.py` (`EngineCore.step`,
`add_request`, `abort_requests`). vLLM runs it in its own process behind
ZeroMQ; here it runs inline, which keeps one step readable end to end:

    schedule() -> execute_model(scheduler_output) -> update_from_output()

Invariant: after `abort_requests` / `finish_requests` or a finished request,
its KV blocks are back in the pool before the next `schedule()`.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from mini_vllm.executor import get_executor_class
from mini_vllm.executor.abstract import Executor
from mini_vllm.metrics.stats import SchedulerStats
from mini_vllm.models.config import ModelConfig
from mini_vllm.scheduler import Request, RequestStatus, Scheduler

logger = logging.getLogger("mini_vllm")


@dataclass
class EngineCoreStep:
    outputs: list = field(default_factory=list)  # EngineCoreOutput, with .logprobs attached
    scheduler_stats: SchedulerStats | None = None
    first_scheduled: list[str] = field(default_factory=list)
    num_prompt_tokens_computed: int = 0
    timings: dict[str, float] = field(default_factory=dict)


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
        self._seen: set[str] = set()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> None:
        """The client's aborts (vLLM's `EngineCore.abort_requests`)."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """Finish requests that were decided outside the scheduler: aborts, and
        the stop strings the detokenizer found (`LLMEngine.step` passes them
        with FINISHED_STOPPED). Their blocks are free before the next
        `schedule()`. Stop tokens, max_tokens and the length limit never come
        here: the scheduler decides those itself in `update_from_output`."""
        self.scheduler.finish_requests(list(request_ids), status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def shutdown(self) -> None:
        """Stop the executor's worker processes (none with one rank)."""
        self.executor.shutdown()

    def step(self) -> EngineCoreStep:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        # Prompt tokens in this step: schedule() already advanced each request by Δ.
        reqs = self.scheduler.requests
        prompt_tokens = sum(
            max(0, min(d, reqs[r].num_prompt_tokens - (reqs[r].num_computed_tokens - d)))
            for r, d in so.num_scheduled_tokens.items())
        t1 = time.perf_counter()
        mro = self.executor.execute_model(so)
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(so, mro)
        if mro.spec_token_ids:
            self._set_drafts(mro.spec_token_ids)
        t3 = time.perf_counter()
        lps = mro.logprobs or {}
        plps = getattr(mro, "prompt_logprobs_dict", None) or {}
        for o in outputs:
            o.logprobs = lps.get(o.request_id, [])[:len(o.new_token_ids)]
            o.prompt_logprobs = plps.get(o.request_id)
        res = EngineCoreStep(outputs, self.make_stats())
        for nr in so.scheduled_new_reqs:
            if nr.req_id not in self._seen:
                self._seen.add(nr.req_id)
                res.first_scheduled.append(nr.req_id)
        self._seen -= so.finished_req_ids
        res.num_prompt_tokens_computed = prompt_tokens
        res.timings = {"schedule": t1 - t0, "execute": t2 - t1, "update": t3 - t2}
        return res

    def _set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Hand the runner's proposals to the scheduler's requests for the next
        `schedule()`. vLLM does this inside the scheduler's `update_from_output`
        (`vllm/v1/core/sched/scheduler.py`, from `ModelRunnerOutput.spec_token_ids`);
        here the engine core does it right after that call, which leaves Chapter
        3's `update_from_output` (and its exercise) free of proposer output.
        Drafts past the last token a request may still emit are dropped, they
        could never be used."""
        for rid, d in drafts.items():
            req = self.scheduler.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                room = req.max_tokens - req.num_output_tokens - 1
                req.spec_token_ids = list(d[:max(0, room)])

    def spec_decoding_stats(self) -> dict | None:
        """Acceptance rate and per-position acceptance of verified drafts: the
        fields of `metrics.stats.SpecDecodingStats` as a dict, None without
        speculative decoding. Every rank verifies; rank 0's counts are the ones
        behind the tokens the engine emits."""
        stats = self.executor.collective_rpc("spec_decoding_stats")[0]
        return None if stats is None else dataclasses.asdict(stats)

    def make_stats(self) -> SchedulerStats:
        s = self.scheduler
        pc = s.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(len(s.running), len(s.waiting) + len(s.staging),
                              s.kv_cache_manager.usage, pc.queries, pc.hits, s.num_preemptions)
