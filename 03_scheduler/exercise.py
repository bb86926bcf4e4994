"""Chapter 3 exercise: write the scheduling decisions of one step.

Run the chapter's tests against your code with
    .venv/bin/pytest -q tests/test_ch3_*.py --impl=exercise
Start with `tests/test_ch3_examples.py`: each of its small cases names the
mistake it catches. Stuck? `03_scheduler/HINTS.md` has hints in three levels,
from the idea to the last push before the solution; read only as much as
you need.

You write six methods, and every step calls all six, asynchronous or not:
`schedule()` decides the plan with the three `StepState` methods, `_apply_plan`
(given) calls `_update_after_schedule` for each scheduled request, and
`update_from_output` (given) calls `_replace_placeholder` for each request that
sampled. So the order that runs is the order to write them in:
1. the two short ones first, in their synchronous form (without them no test
   of `tests/test_ch3_examples.py` can pass):
   - `Scheduler._update_after_schedule`: advance a scheduled request by its Δ;
     say whether this step samples for it;
   - `Scheduler._replace_placeholder`: a sampled token arrived (synchronous
     scheduling holds no placeholder: nothing to do);
2. the four decisions:
   - `StepState.schedule_running`: give a running request its Δ, preempting
     others (or itself) until its KV blocks fit;
   - `StepState.pick_victim`: which running request to preempt;
   - `StepState.try_admit`: admit one waiting request if its first chunk fits;
   - `Scheduler.schedule`: the step loop (fcfs / priority, then srtf / two_level);
3. back to the two short ones for the placeholder rule of asynchronous
   scheduling (the next step is scheduled before this one's tokens are back;
   `tests/test_ch3_async_placeholders.py`): a placeholder, and placeholder
   drafts, for each token a step that samples puts in flight.

A step has two phases: a `StepState` decides a plan (Δ per request, victims,
admissions; it takes and frees KV slots as it decides, but changes neither
the scheduler nor a request), then the scheduler applies it
(`_apply_plan`). Given: `Request` and its two numbers, the queues and policy
orders (`running_order`, `waiting_order`), `StepStateBase` (step_base.py: the
plan's records, `delta`, `remaining`, `_hits`, `refresh`, `preempt` (recompute
or swap), `_commit_running`, `_commit_admission`) and `SchedulerBase`
(scheduler_base.py: `_apply_plan`, `update_from_output`, stop rules, aborts).
Neither holds an answer: a method you have not written raises.
vLLM counterpart: `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`).
"""
from __future__ import annotations

from .config import POLICIES, PREEMPTION_MODES, SchedulerConfig
from .mini_runner import MiniRunner
from .output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from .policy import running_order, waiting_order  # noqa: F401  (for your schedule())
from .request import (PLACEHOLDER_TOKEN_ID, EngineCoreOutput, Request, RequestStatus,  # noqa: F401
                      SchedulerSamplingParams)
from .scheduler_base import SchedulerBase
from .step_base import StepStateBase
from .swap import CpuBlockPool

__all__ = [
    "POLICIES", "PREEMPTION_MODES", "SchedulerConfig", "CachedRequestData",
    "ModelRunnerOutput", "NewRequestData", "SchedulerOutput", "EngineCoreOutput",
    "Request", "RequestStatus", "SchedulerSamplingParams", "Scheduler", "CpuBlockPool", "MiniRunner",
]


class StepState(StepStateBase):
    """One step's plan in the making (step_base.py). Read: `self.kv` the KV cache
    manager, `self.cfg` the config, `self.running` the running batch as this step
    leaves it (less its victims, plus its admissions), `self.budget` tokens left,
    `self.num_scheduled` {req_id: Δ} so far, `self.preempted` {req_id: ...} the
    victims so far. A StepState never changes a request or the scheduler: the
    given `preempt`, `_commit_running` and `_commit_admission` record your
    decisions, and the scheduler applies them after the step's loop."""

    def schedule_running(self, req) -> None:
        """TODO: schedule one running request's Δ, preempting until its blocks fit."""
        raise NotImplementedError(
            "schedule_running(req) -> None. Contract: a request preempted earlier in this step (its id in "
            "self.preempted) or with nothing left (self.delta(...) <= 0) is left alone. Otherwise, on return, "
            "either it is scheduled for its Δ (recorded by self._commit_running) and holds KV slots for its "
            "new tokens and its drafts as lookahead slots (self.kv.allocate_slots), or it was itself a victim "
            "and is not scheduled in this step. Victims are the requests self.pick_victim chooses, preempted "
            "with self.preempt, and only while its slots do not fit. Under asynchronous scheduling, positions "
            "whose token is still in flight (req.num_output_placeholders) count as known: computed ahead "
            "like known tokens, never as drafts; a request whose token in flight is its last (it reaches "
            "max_tokens or max_model_len) gets nothing.")

    def pick_victim(self):
        """TODO: the running request to preempt."""
        raise NotImplementedError(
            "pick_victim() -> the request of self.running to preempt. Contract: never a request already "
            "scheduled or admitted in this step (self.num_scheduled; their blocks may already be shared "
            "as prefix hits), so the requester itself is always a candidate. fcfs (self.cfg.policy): the "
            "last admitted, whatever its priority. Other policies: the lowest priority (largest value), "
            "ties broken by the latest arrival, then by the last admitted.")

    def try_admit(self, req) -> bool:
        """TODO: admit waiting `req` if its first chunk fits; True if admitted."""
        raise NotImplementedError(
            "try_admit(req) -> True iff the waiting request was admitted. Contract: never more than "
            "max_num_seqs in self.running, never past the token budget; a request resumes after its prefix "
            "hits (self._hits), or, swapped out (req.swapped_cpu_block_ids), at its computed tokens with no "
            "lookup; its first chunk is self.delta(...) and, without chunked prefill, must be the whole "
            "rest of the prompt. Admitted means its slots were allocated (self.kv.allocate_slots with the "
            "hits) and self._commit_admission recorded it; not admitted means nothing changed. (The "
            "reference also asks a Chapter 6 KV connector, self.connector; these tests run without one.)")


class Scheduler(SchedulerBase):
    def schedule(self) -> SchedulerOutput:
        """TODO: one scheduling step: decide with a StepState, return `self._apply_plan(st)`."""
        raise NotImplementedError(
            "schedule() -> SchedulerOutput. Contract: the decisions go into one "
            "st = StepState(self.kv_cache_manager, self.config, self.running, self.cpu_block_pool, "
            "self.connector), and the step returns self._apply_plan(st), which moves the requests. "
            "fcfs / priority: running requests are served first, in running_order; waiting ones are "
            "admitted in waiting_order only if nothing was preempted in this step, and the first that does "
            "not fit stops admission (no request overtakes it, or it could starve). srtf / two_level: "
            "seed 001 Algorithm 2, the request with the least remaining work goes first, running or waiting "
            "(ties to the running one); a failed admission ends admission but running requests are "
            "still served. Under every policy, no waiting request is admitted in a step that has "
            "preempted one. The budget (max_num_batched_tokens) and max_num_seqs (counted in st.running) "
            "are never exceeded.")

    def _update_after_schedule(self, req, d: int) -> bool:
        """TODO: `req` was scheduled for Δ = d tokens; advance it. True if this step samples for it."""
        raise NotImplementedError(
            "_update_after_schedule(req, d) -> bool, called by _apply_plan once per scheduled request. "
            "Contract: returns True iff this step samples a token for req: its Δ reaches the end of every "
            "position whose token is known or in flight (req.num_tokens + req.num_output_placeholders; a "
            "mid-prefill chunk does not reach it, draft positions count as reached). With "
            "self.config.async_scheduling the step's tokens are now in flight: req holds one more output "
            "placeholder for the sampled token and one per draft scheduled in this step (positions past "
            "the known and in-flight ones), until they arrive or are rejected; and since the next step is "
            "decided before they are known, req.spec_token_ids becomes self.config.num_spec_tokens "
            "PLACEHOLDER_TOKEN_IDs when req.spec_decode (the runner fills them). Both only when this step samples for "
            "req: a step that samples nothing (a mid-prefill chunk) puts nothing in flight. Otherwise its drafts are "
            "consumed (req.spec_token_ids empty). Either way req.num_computed_tokens has advanced by d.")

    def _replace_placeholder(self, req, sampled: list[int]) -> bool:
        """TODO: the tokens `sampled` of one step arrived for `req`; True if they fill a placeholder."""
        raise NotImplementedError(
            "_replace_placeholder(req, sampled) -> bool, called by update_from_output for every request that "
            "sampled. Contract: False, and nothing changes, when req holds no output placeholder "
            "(synchronous scheduling). Otherwise each arrived token replaces one placeholder (the "
            "rejected drafts' placeholders were removed before this call), and because the runner "
            "appended these tokens itself, they count as already sent to it (req.num_tokens_sent, when "
            "not None, grows by their number; the next step's new_token_ids must not repeat them).")
