"""Chapter 3 exercise: write the scheduling decisions of one step.

Run the chapter's tests against your code with
    .venv/bin/pytest -q tests/test_ch3_*.py --impl=exercise
Start with `tests/test_ch3_examples.py`: each of its small cases names the
mistake it catches.

You write four methods:
- `StepState.schedule_running`: give a running request its Δ, preempting
  others (or itself) until its KV blocks fit;
- `StepState.pick_victim`: which running request to preempt;
- `StepState.try_admit`: admit one waiting request if its first chunk fits;
- `Scheduler.schedule`: the step loop (fcfs / priority, then srtf / two_level).

Given: `Request` and its two numbers, the queues and policy orders
(`running_order`, `waiting_order`), and in `StepState` the budget and
records, `delta`, `remaining`, `_hits`, `refresh`, `preempt` (recompute or
swap), `_commit_running`, `_commit_admission` (the bookkeeping once blocks are
allocated) and `finish`; in `Scheduler` everything but `schedule`
(`update_from_output`, stop rules, aborts, forks). The given classes are copies
of the reference *without* your methods (see `_given`), so a method you have
not written raises instead of quietly running the reference's answer.
vLLM counterpart: `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`).
"""
from __future__ import annotations

from mini_vllm.paged_attention.exercise_support import given_class

from . import scheduler as _sched
from . import step as _step
from .config import POLICIES, PREEMPTION_MODES, SchedulerConfig
from .mini_runner import MiniRunner
from .output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from .policy import running_order, waiting_order  # noqa: F401  (for your schedule())
from .request import EngineCoreOutput, Request, RequestStatus, SamplingParams
from .swap import CpuBlockPool

__all__ = [
    "POLICIES", "PREEMPTION_MODES", "SchedulerConfig", "CachedRequestData",
    "ModelRunnerOutput", "NewRequestData", "SchedulerOutput", "EngineCoreOutput",
    "Request", "RequestStatus", "SamplingParams", "Scheduler", "CpuBlockPool", "MiniRunner",
]


_given = given_class  # a copy of the reference class without the lesson's methods


class StepState(_given(_step.StepState, "schedule_running", "pick_victim", "try_admit")):
    """One step's state: `self.s` the scheduler, `self.kv` its KVCacheManager,
    `self.cfg` its config, `self.budget` tokens left, `self.num_scheduled`
    {req_id: Δ} so far, `self.preempted` ids preempted in this step.
    Nothing changes a request's `num_computed_tokens` before `finish()`, except
    a recompute preemption (0) and an admission (its prefix hits)."""

    def schedule_running(self, req) -> None:
        """TODO: schedule one running request's Δ, preempting until its blocks fit."""
        raise NotImplementedError(
            "schedule_running: return at once if req.status is not RequestStatus.RUNNING (it was "
            "preempted earlier in this step). d = self.delta(req, req.num_computed_tokens, "
            "req.num_tokens_with_spec); return if d <= 0. Then loop: n_spec = max(0, "
            "req.num_computed_tokens + d - req.num_tokens) (draft positions are lookahead slots); new = "
            "self.kv.allocate_slots(req, d - n_spec, num_lookahead_tokens=n_spec). If new is not None "
            "break; else victim = self.pick_victim(), self.preempt(victim), and if the victim is req itself "
            "RETURN (it is preempted, never scheduled in this step); otherwise retry. After the loop: "
            "self._commit_running(req, d, n_spec, new).")

    def pick_victim(self):
        """TODO: the running request to preempt."""
        raise NotImplementedError(
            "pick_victim: candidates are the requests of self.s.running NOT yet in self.num_scheduled (a "
            "request scheduled or admitted in this step already had blocks hashed for tokens it will "
            "write; the requester itself is always a candidate). fcfs (self.cfg.policy): the LAST "
            "candidate in running order (the last admitted), whatever its priority. Other policies: the "
            "largest (priority, arrival_time, index in running): lowest priority, then latest arrival, "
            "then last admitted.")

    def try_admit(self, req) -> bool:
        """TODO: admit waiting `req` if its first chunk fits; True if admitted."""
        raise NotImplementedError(
            "try_admit: False if len(self.s.running) >= self.cfg.max_num_seqs or self.budget <= 0. A "
            "swapped-out request (req.swapped_cpu_block_ids non-empty) skips the prefix cache: hits [], "
            "n_hit 0, computed = req.num_computed_tokens; otherwise hit_blocks, n_hit = self._hits(req) "
            "and computed = n_hit. d = self.delta(req, computed, req.num_tokens). False if d <= 0, or "
            "if d < req.num_tokens - computed without self.cfg.enable_chunked_prefill (a prompt then "
            "goes in whole or waits). False if self.kv.allocate_slots(req, d, n_hit, hit_blocks) is None "
            "(nothing was changed). Else self._commit_admission(req, d, n_hit, swapped) and True. "
            "(The reference also asks a Chapter 6 KV connector for tokens beyond the local hit; "
            "leave that out: these tests run without a connector.)")


class Scheduler(_given(_sched.Scheduler, "schedule")):
    def schedule(self) -> SchedulerOutput:
        """TODO: one scheduling step; returns `st.finish()`."""
        raise NotImplementedError(
            "schedule: st = StepState(self, self.config.max_num_batched_tokens). fcfs / priority: FIRST "
            "every request of running_order(self) with st.schedule_running(req) (stop when st.budget == "
            "0); THEN, only if nothing was preempted (st.preempted empty), admit running down "
            "waiting_order(self) with st.try_admit(req) and STOP at the first that fails (break, not "
            "continue: skipping it would let later requests starve it). srtf / two_level (seed 001 "
            "Algorithm 2): run = running_order(self), cands = waiting_order(self), deltas = "
            "st.refresh(cands); while budget is left, take whichever is smaller, the next run[i]'s "
            "st.remaining(run[i]) or the smallest candidate delta (ties go to the running one; no "
            "candidate once something was preempted or len(self.running) >= max_num_seqs). A running one "
            "gets st.schedule_running if still RUNNING; a candidate is popped and st.try_admit-ed, and "
            "on success deltas = st.refresh(cands) (new blocks can be hits for others); if it fails, "
            "drop all candidates but KEEP serving the running requests. Return st.finish().")
