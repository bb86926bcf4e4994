"""Exercise for Chapter 3: write the core loop of `Scheduler.schedule()`.

Everything else (Request, the queues, `StepState` with its helpers
`schedule_running`, `try_admit`, `refresh`, `remaining`, `finish`, and
`update_from_output`) is given. Run the chapter's tests against your code:

    .venv/bin/python -m pytest -q tests/test_ch3_*.py --impl=exercise
"""
from . import scheduler as _reference
from .config import POLICIES, PREEMPTION_MODES, SchedulerConfig
from .output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from .policy import running_order, waiting_order  # noqa: F401  (you will need them)
from .request import EngineCoreOutput, Request, RequestStatus, SamplingParams
from .step import StepState  # noqa: F401
from .mini_runner import MiniRunner
from .swap import CpuBlockPool

__all__ = [
    "POLICIES", "PREEMPTION_MODES", "SchedulerConfig", "CachedRequestData",
    "ModelRunnerOutput", "NewRequestData", "SchedulerOutput", "EngineCoreOutput",
    "Request", "RequestStatus", "SamplingParams", "Scheduler", "CpuBlockPool", "MiniRunner",
]


class Scheduler(_reference.Scheduler):
    def schedule(self) -> SchedulerOutput:
        """One scheduling step. Start with `st = StepState(self, budget)`.

        fcfs / priority: for each request of `running_order(self)` (stop when
        the budget is 0) call `st.schedule_running(req)`; then, only if
        nothing was preempted (`st.preempted` is empty), admit the requests of
        `waiting_order(self)` with `st.try_admit(req)` until one fails.

        srtf / two_level (seed 001 Algorithm 2): repeatedly pick the smallest
        remaining Δ among the running requests (`st.remaining`) and the
        admission candidates (`st.refresh(cands)`; refresh again after every
        admission, since new blocks can become prefix hits for others).

        Return `st.finish()`.
        """
        raise NotImplementedError(
            "Exercise: write Scheduler.schedule() in 03_scheduler/exercise.py — "
            "running requests first, then waiting ones, each with Δ = min(remaining, budget)")
