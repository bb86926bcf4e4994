"""The scheduler's given half (part of `vllm/v1/core/sched/scheduler.py`, split
out to keep files small and to give the exercise this plumbing without the
lesson's answers): the queues and requests, `add_request`, `_apply_plan` (the
plan a `StepState` decided turned into queue moves, request updates and the
`SchedulerOutput`), `update_from_output`, `finish_requests` and the statistics.
The lesson's methods are in `scheduler.py` (the reference `Scheduler`) and
`exercise.py` (the learner's); both subclass `SchedulerBase`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from mini_vllm.kvcache.kv_cache_utils import cdiv  # Chapter 2

from .config import SchedulerConfig
from .output import CachedRequestData, NewRequestData, SchedulerOutput, SchedulerStats
from .request import EngineCoreOutput, Request, RequestStatus
from .swap import CpuBlockPool
from .utils import check_stop


class SchedulerBase(ABC):
    def __init__(self, config: SchedulerConfig, num_gpu_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, connector=None) -> None:
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be an int >= 1, got {num_gpu_blocks!r}")
        self.config = config
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        from mini_vllm.kvcache import KVCacheManager  # Chapter 2

        self.kv_cache_manager = KVCacheManager(num_gpu_blocks, block_size,
                                               enable_caching=enable_prefix_caching)
        self.cpu_block_pool = CpuBlockPool(config.num_cpu_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.staging: list[Request] = []  # two_level only
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Chapter 6: an optional KV connector (scheduler side), called duck-typed;
        # Chapter 3 never imports Chapter 6.
        self.connector = connector

    # ------------------------------------------------------ the lesson's part
    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """One step: decide a plan with a `StepState`, return `_apply_plan`'s output."""

    @abstractmethod
    def _update_after_schedule(self, req: Request, d: int) -> bool:
        """Advance a scheduled request by its Δ; True if the step samples for it."""

    @abstractmethod
    def _replace_placeholder(self, req: Request, sampled: list[int]) -> bool:
        """A step's tokens arrived; True if they fill an output placeholder."""

    # ------------------------------------------------------------------ API
    def add_request(self, request: Request) -> None:
        """Queue a request; reject one that could never run (ValueError)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt ({request.num_prompt_tokens}) + "
                f"max_tokens ({request.max_tokens}) = {total} exceeds max_model_len "
                f"({self.config.max_model_len})")
        if cdiv(total, self.block_size) > self.num_gpu_blocks:
            raise ValueError(
                f"request {request.request_id!r}: prompt + max_tokens = {total} tokens needs "
                f"{cdiv(total, self.block_size)} KV blocks but the pool has only "
                f"{self.num_gpu_blocks}; it could never run")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.staging or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.staging) + len(self.running)

    def make_stats(self) -> SchedulerStats:
        """This scheduler's counters after a step (vLLM: `Scheduler.make_stats`)."""
        pc = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(len(self.running), len(self.waiting) + len(self.staging),
                              self.kv_cache_manager.usage, pc.queries, pc.hits, self.num_preemptions)

    # ------------------------------------------------------ applying a plan
    def _apply_plan(self, st) -> SchedulerOutput:
        """Apply the plan a `StepState` decided (its KV slots are already taken):
        victims go back to the front of `waiting`, newcomers join `running` with
        their prefix hits as computed; then the `SchedulerOutput`, after which
        every scheduled request has advanced by its Δ (`_update_after_schedule`)."""
        for rid, cpu in st.preempted.items():
            self._preempt_request(self.requests[rid], cpu)
        for req in st.admitted:
            (self.staging if req in self.staging else self.waiting).remove(req)
            req.status = RequestStatus.RUNNING
            if req.swapped_cpu_block_ids:  # its KV comes back from CPU in this step
                self.cpu_block_pool.free(req.swapped_cpu_block_ids)
                req.swapped_cpu_block_ids = []
        for req, _, n_hit, n_ext in st.new_reqs:
            req.num_computed_tokens = n_hit + n_ext  # Table 4.1, prefix caching row
            self._record_prefix_lookup(req, n_hit)
        self.running[:] = st.running
        so = self._make_scheduler_output(st)
        if self.connector is not None:  # loads and saves for the worker-side connector
            so.kv_connector_metadata = self.connector.build_connector_meta(so)
        self._count_for_stats(so)
        return so

    def _preempt_request(self, req: Request, cpu_block_ids: list[int] | None) -> None:
        """A victim of this step (its GPU blocks are free already) waits again,
        first in line; under recompute it restarts from 0, under swap its KV
        waits in `cpu_block_ids` (vLLM: `Scheduler._preempt_request`)."""
        if cpu_block_ids is None:
            req.num_computed_tokens = 0  # Table 4.1, preemption row
        else:
            req.swapped_cpu_block_ids = cpu_block_ids
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _record_prefix_lookup(self, req: Request, n_hit: int) -> None:
        """Count one lookup per admission (a re-admission counts again, as in vLLM);
        `num_cached_tokens` keeps the first admission's computed tokens, as vLLM's."""
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        if self.kv_cache_manager.enable_caching and not req.skip_reading_prefix_cache:
            pc = self.kv_cache_manager.prefix_cache_stats
            pc.requests += 1
            pc.queries += req.num_tokens
            pc.hits += n_hit

    def _make_scheduler_output(self, st) -> SchedulerOutput:
        """What the runner must know of this step; sent tokens counted as sent."""
        kv = self.kv_cache_manager
        out = SchedulerOutput(
            num_scheduled_tokens=dict(st.num_scheduled),
            total_num_scheduled_tokens=sum(st.num_scheduled.values()),
            scheduled_spec_decode_tokens=st.spec,
            preempted_req_ids=set(st.preempted),
            finished_req_ids=self.finished_req_ids,
            blocks_to_swap_out=st.swap_out,
            blocks_to_swap_in=st.swap_in,
            blocks_to_copy=list(kv.take_blocks_to_copy()),
        )
        self.finished_req_ids = set()
        for req, block_ids, _, _ in st.new_reqs:
            req.num_tokens_sent = req.num_tokens
            out.scheduled_new_reqs.append(NewRequestData(
                req.request_id, list(req.prompt_token_ids), list(req.all_token_ids), block_ids,
                req.num_computed_tokens, sampling_params=req.sampling_params, eos_token_id=req.eos_token_id))
        cow = kv.take_cow_request_ids()
        for rid, (resumed, ids) in st.cached.items():
            req = self.requests[rid]
            replace = resumed or rid in cow
            if replace:
                ids = list(kv.get_block_ids(rid))
            out.scheduled_cached_reqs.append(CachedRequestData(
                rid, resumed, ids, req.num_computed_tokens,
                new_token_ids=req.all_token_ids[req.num_tokens_sent:], replace_block_ids=replace))
            req.num_tokens_sent = req.num_tokens
        for rid, d in st.num_scheduled.items():
            if self._update_after_schedule(self.requests[rid], d):
                out.sampling_req_ids.add(rid)
        return out

    def _count_for_stats(self, so: SchedulerOutput) -> None:
        """The step's prompt tokens and first-time requests, for the metrics. Each
        scheduled request has already advanced by its Δ, so the Δ tokens started at
        num_computed_tokens - Δ; those below num_prompt_tokens are prompt tokens."""
        reqs = self.requests
        so.num_prompt_tokens = sum(
            max(0, min(d, reqs[r].num_prompt_tokens - (reqs[r].num_computed_tokens - d)))
            for r, d in so.num_scheduled_tokens.items())
        # A request comes back through scheduled_new_reqs after a recompute
        # preemption; only one never preempted is scheduled for the first time.
        so.first_scheduled_req_ids = [nr.req_id for nr in so.scheduled_new_reqs
                                      if reqs[nr.req_id].num_preemptions == 0]

    # ------------------------------------------------------- the runner's answer
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output) -> list[EngineCoreOutput]:
        """Append sampled tokens, roll back rejected drafts, apply stop rules.

        All or nothing: the whole runner output is checked before any request
        changes, so a bad output raises a ValueError and leaves every request
        as it was. Sampled-token counts per scheduled request: 1..k+1 after
        verifying k drafts; exactly 1 for a request that completed its tokens
        without drafts; 0 or 1 for a mid-prefill chunk, and that one is
        discarded (a runner may sample every row; the token is meaningless).

        Asynchronous scheduling: a later step may already be scheduled, so
        whether this step sampled comes from `sampling_req_ids` (decided when
        it was scheduled), each token that arrives replaces one placeholder,
        and a request preempted meanwhile still gets its token (it was
        sampled; dropping it would make a seeded request draw it again).
        """
        mro = model_runner_output
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        sampling = scheduler_output.sampling_req_ids
        checked = []  # (request, sampled token ids to append, rejected drafts)
        for req_id in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.is_finished():
                continue  # aborted (or finished) since the step was scheduled
            idx = mro.req_id_to_index.get(req_id)
            sampled = [int(t) for t in mro.sampled_token_ids[idx]] if idx is not None else []
            drafts = spec_tokens.get(req_id) if spec_tokens else None
            rejected = 0
            if drafts:
                if not 1 <= len(sampled) <= len(drafts) + 1:
                    raise ValueError(f"request {req_id!r}: verifying {len(drafts)} drafts must "
                                     f"yield 1..{len(drafts) + 1} tokens, got {len(sampled)}")
                rejected = len(drafts) - (len(sampled) - 1)
            if req_id not in sampling:  # mid-prefill chunk
                if not drafts and len(sampled) > 1:
                    raise ValueError(f"request {req_id!r} is mid-prefill: the runner may sample "
                                     f"0 or 1 token (discarded), got {len(sampled)}")
                checked.append((req, [], rejected))
                continue
            if not drafts and len(sampled) != 1:
                raise ValueError(f"request {req_id!r} completed its tokens this step without drafts: "
                                 f"the runner must sample exactly 1 token, got {len(sampled)}")
            checked.append((req, sampled, rejected))

        outputs = []
        for req, sampled, rejected in checked:
            if req.status == RequestStatus.RUNNING:
                req.num_computed_tokens -= rejected  # Table 4.1, speculative decoding row
            if req.num_output_placeholders:  # asynchronous: a rejected draft was a placeholder too
                req.num_output_placeholders -= rejected
            if not sampled:
                continue  # mid-prefill chunk: nothing is sampled yet
            placeholder = self._replace_placeholder(req, sampled)
            new_ids: list[int] = []
            status = None
            for tok in sampled:
                req.append_output_token_ids(tok)  # one token at a time: stop rules may cut a multi-token output
                new_ids.append(tok)
                status = check_stop(req, tok, self.config.max_model_len)
                if status is not None:
                    break
            if placeholder and req.status == RequestStatus.RUNNING:
                # The tokens just arrived may complete blocks that the next allocation
                # would never see (a request that finishes now is not scheduled again):
                # hash and cache them now that their tokens are known (vLLM caches in
                # the update under asynchronous scheduling too). No new slot is taken.
                self.kv_cache_manager.allocate_slots(req, 0)
            if status is not None:
                self._free_request(req, status)
            reason = req.get_finished_reason() if status is not None else None
            outputs.append(EngineCoreOutput(req.request_id, new_ids, reason, rejected,
                                            max(req.num_cached_tokens, 0)))
        return outputs

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Drafts a proposer made for the next `schedule()` (vLLM's method of the
        same name, called by the engine core after `update_from_output`). Drafts
        past the last token a request may still emit are dropped: they could
        never be used. Finished or preempted requests get none."""
        for rid, d in draft_token_ids.items():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                room = req.max_tokens - req.num_output_tokens - 1
                req.spec_token_ids = list(d[:max(0, room)])

    def finish_requests(self, request_ids, finished_status: RequestStatus) -> None:
        """Finish requests from the outside (abort), in any state."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._free_request(req, finished_status)

    # ------------------------------------------------------------- internals
    def _free_request(self, req: Request, status: RequestStatus) -> None:
        """End `req` with `status`: out of its queue, its GPU and CPU blocks
        freed, reported in the next step's `finished_req_ids` (vLLM:
        `Scheduler._free_request`, with the status set by its callers)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.staging:
            self.staging.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.connector is not None:
            self.connector.request_finished(req, self.kv_cache_manager.get_block_ids(req.request_id))
        self.kv_cache_manager.free(req)
        if req.swapped_cpu_block_ids:
            self.cpu_block_pool.free(req.swapped_cpu_block_ids)
            req.swapped_cpu_block_ids = []
        req.status = status
        del self.requests[req.request_id]
        self.finished_req_ids.add(req.request_id)
