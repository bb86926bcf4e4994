"""The continuous-batching scheduler (counterpart of `vllm/v1/core/sched/scheduler.py`).

One step = one call to `schedule()`, one forward pass by the runner, one call
to `update_from_output()`. Under a token budget B, each scheduled request r
advances by Δ_r = min(remaining_r, B_left) tokens (seed 001 §4.4.2):
prefill, decode, chunked prefill, prefix hits, preemption and speculative
decoding are all updates of `num_computed_tokens` against `num_tokens`.

Invariants after every `schedule()`:
* Σ Δ_r <= max_num_batched_tokens and len(running) <= max_num_seqs;
* a request's `num_computed_tokens` never decreases, except when it is
  preempted under recompute (reset to 0) or drafts are rejected (rollback);
* every RUNNING request owns exactly the KV blocks for its computed tokens
  plus this step's tokens; WAITING/PREEMPTED/FINISHED requests own none
  (a swapped request owns CPU blocks instead).
"""
from __future__ import annotations

from collections import deque

from mini_vllm.kvcache.kv_cache_utils import cdiv  # Chapter 2

from .config import SchedulerConfig
from .output import SchedulerOutput, SchedulerStats
from .policy import running_order, waiting_order
from .request import EngineCoreOutput, Request, RequestStatus
from .step import StepState
from .swap import CpuBlockPool


class Scheduler:
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

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and their Δ.

        fcfs / priority: running requests first (in policy order), then
        waiting ones until one does not fit (no skipping: no starvation).
        srtf / two_level: Algorithm 2 of seed 001 — repeatedly take the
        request with the smallest remaining Δ among running ∪ candidates,
        refreshing the candidates' prefix hits after every admission.
        """
        st = StepState(self, self.config.max_num_batched_tokens)
        cfg = self.config
        if cfg.policy in ("fcfs", "priority"):
            for req in running_order(self):
                if st.budget == 0:
                    break
                st.schedule_running(req)
            if not st.preempted:
                for req in waiting_order(self):
                    if st.budget == 0 or not st.try_admit(req):
                        break
        else:
            run = running_order(self)  # sorted by remaining Δ; fixed this step
            cands = waiting_order(self)  # all waiting (srtf) or the staging queue
            deltas = st.refresh(cands)
            i = 0
            while st.budget > 0:
                admit_ok = cands and not st.preempted and len(self.running) < cfg.max_num_seqs
                j = min(range(len(cands)), key=deltas.__getitem__) if admit_ok else None
                if i < len(run) and (j is None or st.remaining(run[i]) <= deltas[j]):
                    if run[i].status == RequestStatus.RUNNING:
                        st.schedule_running(run[i])
                    i += 1
                elif j is not None:
                    req = cands.pop(j)
                    if st.try_admit(req):
                        deltas = st.refresh(cands)  # new blocks may be prefix hits for others
                    else:  # the shortest does not fit: stop admitting, keep serving running
                        cands, deltas = [], []
                else:
                    break
        so = st.finish()
        if self.connector is not None:  # loads and saves for the worker-side connector
            so.kv_connector_metadata = self.connector.build_connector_meta(so)
        self._count_for_stats(so)
        return so

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

    def make_stats(self) -> SchedulerStats:
        """This scheduler's counters after a step (vLLM: `Scheduler.make_stats`)."""
        pc = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(len(self.running), len(self.waiting) + len(self.staging),
                              self.kv_cache_manager.usage, pc.queries, pc.hits, self.num_preemptions)

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
        plan = []  # (request, sampled token ids to append, rejected drafts)
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
                plan.append((req, [], rejected))
                continue
            if not drafts and len(sampled) != 1:
                raise ValueError(f"request {req_id!r} completed its tokens this step without drafts: "
                                 f"the runner must sample exactly 1 token, got {len(sampled)}")
            plan.append((req, sampled, rejected))

        outputs = []
        for req, sampled, rejected in plan:
            if req.status == RequestStatus.RUNNING:
                req.num_computed_tokens -= rejected  # Table 4.1, speculative decoding row
            if not sampled:
                continue  # mid-prefill chunk: nothing is sampled yet
            placeholder = self._replace_placeholder(req, sampled)
            new_ids: list[int] = []
            status = None
            for tok in sampled:
                req.append_output_token_ids(tok)  # one token at a time: stop rules may cut a multi-token output
                new_ids.append(tok)
                status = self._check_stop(req, tok)
                if status is not None:
                    break
            if placeholder and req.status == RequestStatus.RUNNING:
                # The tokens just arrived may complete blocks that the next allocation
                # would never see (a request that finishes now is not scheduled again):
                # hash and cache them now that their tokens are known (vLLM caches in
                # the update under asynchronous scheduling too). No new slot is taken.
                self.kv_cache_manager.allocate_slots(req, 0)
            if status is not None:
                self._finish(req, status)
            reason = req.get_finished_reason() if status is not None else None
            outputs.append(EngineCoreOutput(req.request_id, new_ids, reason, rejected,
                                            max(req.num_cached_tokens, 0)))
        return outputs

    def _replace_placeholder(self, req, sampled: list[int]) -> bool:
        """Tokens of one step arrived for `req`: True if they fill a placeholder
        (asynchronous scheduling counted one when the step was scheduled), which
        they then replace; the runner appended them already, so they count as sent
        (vLLM: `AsyncScheduler._update_request_with_output`)."""
        if req.num_output_placeholders == 0:
            return False  # synchronous, or a step scheduled before any was counted
        req.num_output_placeholders -= 1
        if req.num_tokens_sent is not None:
            req.num_tokens_sent += len(sampled)  # the runner appended them itself
        return True

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
                self._finish(req, finished_status)

    # ------------------------------------------------------------- internals
    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        """Stop rules for `tok`, the token just appended to `req`."""
        sp = req.sampling_params
        if req.num_output_tokens < sp.min_tokens:
            # min_tokens: EOS and stop ids do not count yet (the sampler masks them too).
            if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.config.max_model_len:
                return RequestStatus.FINISHED_LENGTH_CAPPED
            return None
        if not sp.ignore_eos and req.eos_token_id is not None and tok == req.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if tok in sp.stop_token_ids:
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
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

