"""Book-keeping for one `Scheduler.schedule()` call (part of the logic of
`vllm/v1/core/sched/scheduler.py`, split out to keep files small).

`StepState` holds the remaining token budget and what has been decided so
far; its methods are the building blocks of the scheduling loop:
`schedule_running`, `try_admit`, `preempt` (inside them) and `finish`.
Nothing in a request's `num_computed_tokens` changes until `finish()`,
except a recompute preemption (reset to 0) and admission (prefix hits).
"""
from __future__ import annotations

from mini_vllm.kvcache.kv_cache_utils import cdiv  # Chapter 2

from .output import CachedRequestData, NewRequestData, SchedulerOutput
from .request import RequestStatus


def _new_request_data(req, block_ids) -> NewRequestData:
    req.num_tokens_sent = req.num_tokens
    return NewRequestData(req.request_id, list(req.prompt_token_ids), list(req.all_token_ids),
                          list(block_ids), req.num_computed_tokens,
                          sampling_params=req.sampling_params, eos_token_id=req.eos_token_id)


class StepState:
    def __init__(self, sched, budget: int) -> None:
        self.s = sched
        self.kv = sched.kv_cache_manager
        self.cfg = sched.config
        self.budget = budget
        self.num_scheduled: dict[str, int] = {}
        self.spec: dict[str, list[int]] = {}
        self.new_reqs: list = []
        self.cached: dict[str, tuple[bool, list[int]]] = {}
        self.preempted: set[str] = set()
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.cpu_to_free: list[int] = []

    # ---------------------------------------------------------------- Δ
    @staticmethod
    def remaining(req) -> int:
        return req.num_tokens_with_spec + req.num_output_placeholders - req.num_computed_tokens

    def delta(self, req, computed: int, total: int) -> int:
        """Δ = min(remaining, budget left), capped by max_model_len and, for
        prefills, by long_prefill_token_threshold (a chunking knob: ignored
        without chunked prefill, where a prefill must go in one piece)."""
        d = min(total - computed, self.budget, self.cfg.max_model_len - computed)
        thr = self.cfg.long_prefill_token_threshold
        if thr and self.cfg.enable_chunked_prefill and req.num_tokens - computed > 1:
            d = min(d, thr)
        return d

    def _hits(self, req):
        """Prefix-cache hit, never covering the last token (it must be computed
        to sample from it).

        A probe: it leaves `prefix_cache_stats` unchanged. SRTF refreshes every
        candidate each step and a request may fail admission for many steps,
        so counting every lookup would inflate the statistics; `try_admit`
        records one lookup per admission instead (`_record_hits`).
        """
        if req.skip_reading_prefix_cache:  # vLLM: no lookup, not counted
            return [], 0
        st = self.kv.prefix_cache_stats
        saved = (st.requests, st.queries, st.hits)
        blocks, n = self.kv.get_computed_blocks(req)
        st.requests, st.queries, st.hits = saved
        blocks = list(blocks)
        while n >= req.num_tokens:
            blocks.pop()
            n -= self.s.block_size
        return blocks, n

    def _record_hits(self, req, n_hit: int) -> None:
        """Count one prefix-cache lookup for an admitted request (a request
        re-admitted after a recompute preemption looks up again and counts
        again, as vLLM does). The request's `num_cached_tokens` keeps its first admission's
        computed tokens only, as vLLM's does."""
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        if self.kv.enable_caching and not req.skip_reading_prefix_cache:
            st = self.kv.prefix_cache_stats
            st.requests += 1
            st.queries += req.num_tokens
            st.hits += n_hit

    def refresh(self, cands) -> list[int]:
        """Remaining Δ of each admission candidate after prefix-cache lookup."""
        out = []
        for req in cands:
            if req.swapped_cpu_block_ids:
                out.append(req.num_tokens - req.num_computed_tokens)
            else:
                out.append(req.num_tokens - self._hits(req)[1])
        return out

    # ------------------------------------------------------------ running
    def schedule_running(self, req) -> None:
        if req.status != RequestStatus.RUNNING:
            return  # preempted earlier in this step
        ph = req.num_output_placeholders
        if ph and (req.num_output_tokens + ph >= req.max_tokens or req.num_tokens + ph >= self.cfg.max_model_len):
            return  # asynchronous: the token in flight is its last; nothing to compute ahead
        # Placeholders (asynchronous scheduling) are positions whose token is in flight:
        # computed ahead like known ones, and, like them, never drafts.
        known = req.num_tokens + req.num_output_placeholders
        d = self.delta(req, req.num_computed_tokens, req.num_tokens_with_spec + req.num_output_placeholders)
        if d <= 0:
            return
        while True:
            # Draft positions are lookahead slots: allocated, never hashed.
            n_spec = max(0, req.num_computed_tokens + d - known)
            new = self.kv.allocate_slots(req, d - n_spec, num_lookahead_tokens=n_spec)
            if new is not None:
                break
            victim = self.pick_victim()
            self.preempt(victim)
            if victim is req:
                return
        self._commit_running(req, d, n_spec, new)

    def _commit_running(self, req, d: int, n_spec: int, new_blocks) -> None:
        """Record a running request's Δ (its blocks are allocated): charge the
        budget, note its drafts and its new block ids for the runner."""
        rid = req.request_id
        self.budget -= d
        self.num_scheduled[rid] = d
        if n_spec:
            self.spec[rid] = list(req.spec_token_ids[:n_spec])
        self.cached[rid] = (False, [b.block_id for b in new_blocks] if new_blocks else [])  # decode: usually none

    def pick_victim(self):
        """The preemption victim among the running requests not yet scheduled
        in this step, which also excludes those admitted in it (the requester
        is one of them, so there is always a candidate).

        fcfs: the last admitted (the tail of `running`, as vLLM's FCFS pops
        it); the priority field is ignored. priority, srtf, two_level: lowest
        priority (largest value), then latest arrival, then last admitted.

        A request scheduled earlier in this step is never the victim: its
        `allocate_slots` already hashed the blocks this step will fill, and a
        request admitted after it may already hold them as prefix hits. Undoing
        it would leave hashes on blocks whose tokens are never written.
        """
        cands = [(r.priority, r.arrival_time, i, r) for i, r in enumerate(self.s.running)
                 if r.request_id not in self.num_scheduled]
        if self.cfg.policy == "fcfs":
            return cands[-1][3]
        return max(cands, key=lambda c: c[:3])[3]

    def preempt(self, victim) -> None:
        s, rid = self.s, victim.request_id
        assert rid not in self.num_scheduled, "a request scheduled in this step cannot be preempted"
        s.running.remove(victim)
        n_keep = cdiv(victim.num_computed_tokens, s.block_size)
        cpu = None
        if self.cfg.preemption_mode == "swap" and n_keep > 0:
            cpu = s.cpu_block_pool.allocate(n_keep)
        if cpu is not None:
            gpu = self.kv.get_block_ids(rid)[:n_keep]
            self.swap_out.extend(zip(gpu, cpu))
            victim.swapped_cpu_block_ids = cpu
        else:  # recompute (or the CPU pool is full): Table 4.1 preemption row
            victim.num_computed_tokens = 0
        self.kv.free(victim)
        victim.spec_token_ids = []
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        s.num_preemptions += 1
        s.waiting.appendleft(victim)
        self.preempted.add(rid)

    # ------------------------------------------------------------ waiting
    def try_admit(self, req) -> bool:
        """Move one waiting request to running if its first chunk fits."""
        s, cfg = self.s, self.cfg
        if len(s.running) >= cfg.max_num_seqs or self.budget <= 0:
            return False
        if req.num_output_placeholders:
            # Preempted with a token in flight: resume once it is known. With the core's
            # queue of two the update always comes before the next schedule; this keeps
            # a deeper queue from computing a position whose token the runner lacks.
            return False
        swapped = bool(req.swapped_cpu_block_ids)
        n_ext = 0  # Chapter 6: tokens a KV connector loads beyond the local prefix hit
        if swapped:
            hit_blocks, n_hit, computed = [], 0, req.num_computed_tokens
        else:
            hit_blocks, n_hit = self._hits(req)
            if s.connector is not None and not req.skip_reading_prefix_cache:
                n_ext = s.connector.get_num_new_matched_tokens(req, n_hit)[0]
            computed = n_hit + n_ext
        d = self.delta(req, computed, req.num_tokens)
        if d <= 0 or (d < req.num_tokens - computed and not cfg.enable_chunked_prefill):
            return False
        # External tokens need slots like new ones (the connector fills them before the forward).
        if self.kv.allocate_slots(req, n_ext + d, n_hit, hit_blocks) is None:
            return False
        if not swapped and s.connector is not None:
            s.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), n_ext)
        self._commit_admission(req, d, n_hit, swapped, n_ext)
        return True

    def _commit_admission(self, req, d: int, n_hit: int, swapped: bool, n_ext: int = 0) -> None:
        """Move an admitted request (its blocks are allocated) from waiting or
        staging to running: charge the budget, set its prefix hits as computed
        (or plan its swap-in) and record what the runner must be told."""
        s = self.s
        if req in s.staging:
            s.staging.remove(req)
        else:
            s.waiting.remove(req)
        rid = req.request_id
        req.status = RequestStatus.RUNNING
        s.running.append(req)
        self.budget -= d
        self.num_scheduled[rid] = d
        block_ids = list(self.kv.get_block_ids(rid))
        if swapped:
            cpu = req.swapped_cpu_block_ids
            self.swap_in.extend(zip(cpu, block_ids[:len(cpu)]))
            self.cpu_to_free.extend(cpu)
            req.swapped_cpu_block_ids = []
            self.cached[rid] = (True, block_ids)
        else:
            req.num_computed_tokens = n_hit + n_ext  # Table 4.1, prefix caching row
            self._record_hits(req, n_hit)
            self.new_reqs.append((req, block_ids))

    # ------------------------------------------------------------- output
    def _update_after_schedule(self, req, d: int) -> bool:
        """A scheduled request's Δ is decided: advance it; True if this step samples
        a token for it (vLLM: `Scheduler._update_after_schedule`, and the placeholder
        count of `AsyncScheduler`'s override)."""
        # Samples iff the step reaches the end of its known tokens and placeholders (a
        # mid-prefill chunk does not); drafts count as reached.
        samples = req.num_computed_tokens + d >= req.num_tokens + req.num_output_placeholders
        if samples and self.cfg.async_scheduling:
            req.num_output_placeholders += 1  # its token is now in flight
        req.num_computed_tokens += d
        req.spec_token_ids = []  # consumed (or trimmed away) this step
        return samples

    def finish(self) -> SchedulerOutput:
        s = self.s
        out = SchedulerOutput(
            num_scheduled_tokens=dict(self.num_scheduled),
            total_num_scheduled_tokens=sum(self.num_scheduled.values()),
            scheduled_spec_decode_tokens=self.spec,
            preempted_req_ids=set(self.preempted),
            finished_req_ids=s.finished_req_ids,
            blocks_to_swap_out=self.swap_out,
            blocks_to_swap_in=self.swap_in,
            blocks_to_copy=list(self.kv.take_blocks_to_copy()),
        )
        s.finished_req_ids = set()
        for req, block_ids in self.new_reqs:
            if req.request_id in self.num_scheduled:
                out.scheduled_new_reqs.append(_new_request_data(req, block_ids))
        cow = self.kv.take_cow_request_ids()
        for rid, (resumed, ids) in self.cached.items():
            req = s.requests[rid]
            replace = resumed or rid in cow
            if replace:
                ids = list(self.kv.get_block_ids(rid))
            out.scheduled_cached_reqs.append(CachedRequestData(
                rid, resumed, ids, req.num_computed_tokens,
                new_token_ids=req.all_token_ids[req.num_tokens_sent:], replace_block_ids=replace))
            req.num_tokens_sent = req.num_tokens
        for rid, d in self.num_scheduled.items():
            if self._update_after_schedule(s.requests[rid], d):
                out.sampling_req_ids.add(rid)
        if self.cpu_to_free:
            s.cpu_block_pool.free(self.cpu_to_free)
        return out
