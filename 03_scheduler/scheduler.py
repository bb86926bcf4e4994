"""The continuous-batching scheduler (counterpart of `vllm/v1/core/sched/scheduler.py`).

One step = one call to `schedule()`, one forward pass by the runner, one call
to `update_from_output()`. Under a token budget B, each scheduled request r
advances by Δ_r = min(remaining_r, B_left) tokens (seed 001 §4.4.2):
prefill, decode, chunked prefill, prefix hits, preemption and speculative
decoding are all updates of `num_computed_tokens` against `num_tokens`.

A step has two phases. A `StepState` (step.py) decides: who runs for how
many tokens, whom to preempt, whom to admit; it takes KV slots as it goes but
changes neither the scheduler nor a request. Then `_apply_plan`
(scheduler_base.py, with the rest of the scheduler: `add_request`,
`update_from_output`, `finish_requests`) applies that plan and builds the
`SchedulerOutput`. This file holds the lesson: the step loop and the
placeholder rule of asynchronous scheduling.

Invariants after every `schedule()`:
* Σ Δ_r <= max_num_batched_tokens and len(running) <= max_num_seqs;
* a request's `num_computed_tokens` never decreases, except when it is
  preempted under recompute (reset to 0) or drafts are rejected (rollback);
* every RUNNING request owns exactly the KV blocks for its computed tokens
  plus this step's tokens; WAITING/PREEMPTED/FINISHED requests own none
  (a swapped request owns CPU blocks instead).
"""
from __future__ import annotations

from .output import SchedulerOutput
from .policy import running_order, waiting_order
from .request import PLACEHOLDER_TOKEN_ID, Request
from .scheduler_base import SchedulerBase
from .step import StepState


class Scheduler(SchedulerBase):
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and their Δ.

        fcfs / priority: running requests first (in policy order), then
        waiting ones until one does not fit (no skipping: no starvation).
        srtf / two_level: Algorithm 2 of seed 001 — repeatedly take the
        request with the smallest remaining Δ among running ∪ candidates,
        refreshing the candidates' prefix hits after every admission.
        Under every policy, a step that preempts admits no one.
        """
        st = StepState(self.kv_cache_manager, self.config, self.running, self.cpu_block_pool, self.connector)
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
                admit_ok = cands and not st.preempted and len(st.running) < cfg.max_num_seqs
                j = min(range(len(cands)), key=deltas.__getitem__) if admit_ok else None
                if i < len(run) and (j is None or st.remaining(run[i]) <= deltas[j]):
                    st.schedule_running(run[i])  # skips one preempted earlier in this step
                    i += 1
                elif j is not None:
                    req = cands.pop(j)
                    if st.try_admit(req):
                        deltas = st.refresh(cands)  # new blocks may be prefix hits for others
                    else:  # the shortest does not fit: stop admitting, keep serving running
                        cands, deltas = [], []
                else:
                    break
        return self._apply_plan(st)

    def _update_after_schedule(self, req: Request, d: int) -> bool:
        """A scheduled request's Δ is decided: advance it; True if this step samples
        a token for it (vLLM: `Scheduler._update_after_schedule`, and the placeholder
        count of `AsyncScheduler`'s override)."""
        # Samples iff the step reaches the end of its known tokens and placeholders (a
        # mid-prefill chunk does not); drafts count as reached.
        known = req.num_tokens + req.num_output_placeholders
        samples = req.num_computed_tokens + d >= known
        req.spec_token_ids = []  # consumed (or trimmed away) this step
        if samples and self.config.async_scheduling:
            # Up to 1 + (drafts scheduled) tokens are now in flight, each a placeholder;
            # the next step gets k placeholder drafts, which the runner fills.
            req.num_output_placeholders += 1 + max(0, req.num_computed_tokens + d - known)
            if req.spec_decode:
                req.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * self.config.num_spec_tokens
        req.num_computed_tokens += d
        return samples

    def _replace_placeholder(self, req: Request, sampled: list[int]) -> bool:
        """Tokens of one step arrived for `req`: True if they fill a placeholder
        (asynchronous scheduling counted one when the step was scheduled), which
        they then replace; the runner appended them already, so they count as sent
        (vLLM: `AsyncScheduler._update_request_with_output`)."""
        if req.num_output_placeholders == 0:
            return False  # synchronous, or a step scheduled before any was counted
        req.num_output_placeholders -= len(sampled)
        if req.num_tokens_sent is not None:
            req.num_tokens_sent += len(sampled)  # the runner appended them itself
        return True
