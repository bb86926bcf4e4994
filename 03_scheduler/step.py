"""The decisions of one `Scheduler.schedule()` call (part of the logic of
`vllm/v1/core/sched/scheduler.py`: its running and waiting loops' bodies and
`_preempt_request`'s choice of victim, split out to keep files small).

`StepState` adds the lesson's three decisions to the plan of
`step_base.StepStateBase`: `schedule_running` (a running request's Δ, or a
preemption), `pick_victim` and `try_admit`. It reads the requests and never
changes them; the scheduler applies the plan afterwards.
"""
from __future__ import annotations

from .step_base import StepStateBase


class StepState(StepStateBase):
    # ------------------------------------------------------------ running
    def schedule_running(self, req) -> None:
        if req.request_id in self.preempted:
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

    def pick_victim(self):
        """The preemption victim among the running requests (`self.running`)
        not yet scheduled in this step, which also excludes those admitted in
        it (the requester is one of them, so there is always a candidate).

        fcfs: the last admitted (the tail of `running`, as vLLM's FCFS pops
        it); the priority field is ignored. priority, srtf, two_level: lowest
        priority (largest value), then latest arrival, then last admitted.

        A request scheduled earlier in this step is never the victim: its
        `allocate_slots` already hashed the blocks this step will fill, and a
        request admitted after it may already hold them as prefix hits. Undoing
        it would leave hashes on blocks whose tokens are never written.
        """
        cands = [(r.priority, r.arrival_time, i, r) for i, r in enumerate(self.running)
                 if r.request_id not in self.num_scheduled]
        if self.cfg.policy == "fcfs":
            return cands[-1][3]
        return max(cands, key=lambda c: c[:3])[3]

    # ------------------------------------------------------------ waiting
    def try_admit(self, req) -> bool:
        """Admit one waiting request if its first chunk fits."""
        cfg = self.cfg
        if len(self.running) >= cfg.max_num_seqs or self.budget <= 0:
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
            if self.connector is not None and not req.skip_reading_prefix_cache:
                n_ext = self.connector.get_num_new_matched_tokens(req, n_hit)[0]
            computed = n_hit + n_ext
        d = self.delta(req, computed, req.num_tokens)
        if d <= 0 or (d < req.num_tokens - computed and not cfg.enable_chunked_prefill):
            return False
        # External tokens need slots like new ones (the connector fills them before the forward).
        if self.kv.allocate_slots(req, n_ext + d, n_hit, hit_blocks) is None:
            return False
        if not swapped and self.connector is not None:
            self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), n_ext)
        self._commit_admission(req, d, n_hit, swapped, n_ext)
        return True
