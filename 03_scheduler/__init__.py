"""Chapter 3: the scheduler (continuous batching, chunked prefill, preemption).

Mirrors `vllm/v1/request.py`, `vllm/v1/core/sched/output.py`,
`vllm/v1/core/sched/scheduler.py` and `vllm/v1/outputs.py`.
"""
from mini_vllm.scheduler.config import POLICIES, PREEMPTION_MODES, SchedulerConfig
from mini_vllm.scheduler.output import (CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput,
                                        SchedulerStats)
from mini_vllm.scheduler.request import (PLACEHOLDER_TOKEN_ID, EngineCoreOutput, Request, RequestStatus,
                                         SchedulerSamplingParams)
from mini_vllm.scheduler.scheduler import Scheduler
from mini_vllm.scheduler.mini_runner import MiniRunner
from mini_vllm.scheduler.swap import CpuBlockPool

__all__ = [
    "POLICIES", "PREEMPTION_MODES", "SchedulerConfig", "CachedRequestData",
    "ModelRunnerOutput", "NewRequestData", "SchedulerOutput", "SchedulerStats", "EngineCoreOutput",
    "PLACEHOLDER_TOKEN_ID", "Request", "RequestStatus", "SchedulerSamplingParams", "Scheduler", "CpuBlockPool",
    "MiniRunner",
]
