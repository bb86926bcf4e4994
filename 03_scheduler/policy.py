"""Scheduling policies: in which order requests are considered each step
(cf. `vllm/v1/core/sched/request_queue.py`; SRTF and two-level from seed 001 §4.5).

* fcfs      — running in admission order, waiting in arrival order.
* priority  — (priority, arrival_time) ascending; lower value is served first.
* srtf      — smallest remaining Δ first over running ∪ waiting; the waiting
              requests' Δ is refreshed against the prefix cache (§4.5.2).
* two_level — FIFO waiting queue feeding a small staging queue, which is
              refilled only once empty; SRTF over running ∪ staging (§4.5.3).

Every function returns a fresh list: the step loop may pop from it (srtf),
and the scheduler changes its own queues when it applies the step's plan.
"""
from __future__ import annotations


def _prio_key(req):
    return (req.priority, req.arrival_time)


def _remaining_key(req):
    return (req.num_tokens_with_spec - req.num_computed_tokens, req.arrival_time)


def running_order(sched) -> list:
    policy = sched.config.policy
    if policy == "fcfs":
        return list(sched.running)
    if policy == "priority":
        return sorted(sched.running, key=_prio_key)
    return sorted(sched.running, key=_remaining_key)


def waiting_order(sched) -> list:
    """Admission candidates. For two_level, refills the staging queue first."""
    policy = sched.config.policy
    if policy == "fcfs" or policy == "srtf":
        return list(sched.waiting)
    if policy == "priority":
        return sorted(sched.waiting, key=_prio_key)
    # two_level: a whole batch moves from waiting to staging only when staging
    # is empty, so every staged request is served before anyone overtakes it.
    if not sched.staging:
        while sched.waiting and len(sched.staging) < sched.config.staging_size:
            sched.staging.append(sched.waiting.popleft())
    return list(sched.staging)
