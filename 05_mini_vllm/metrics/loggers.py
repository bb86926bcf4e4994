"""Stat loggers: the engine's running totals and the periodic log line.

vLLM counterpart: `vllm/v1/metrics/loggers.py` (`LoggingStatLogger`, which
logs throughput every few seconds; `PrometheusStatLogger` is `prometheus.py`
here). `EngineMetrics` accumulates everything since the engine started, so a
benchmark or `make demo` can print one table at the end; it is what
`LLMEngine.get_stats()` summarises.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from mini_vllm.metrics.stats import FinishedRequestStats, IterationStats, percentile

logger = logging.getLogger("mini_vllm")


@dataclass
class EngineMetrics:
    start_time: float = field(default_factory=time.monotonic)
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    num_finished: int = 0
    max_kv_cache_usage: float = 0.0
    last_scheduler_stats: object = None
    step_time_s: dict[str, float] = field(default_factory=dict)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    iteration_tokens: list[int] = field(default_factory=list)  # prompt + generated tokens per step

    def record(self, it: IterationStats, sched_stats, timings: dict[str, float]) -> None:
        self.num_steps += 1
        self.iteration_tokens.append(it.num_prompt_tokens + it.num_generation_tokens)
        self.finished += it.finished_requests
        self.num_prompt_tokens += it.num_prompt_tokens
        self.num_generation_tokens += it.num_generation_tokens
        self.ttfts += it.time_to_first_tokens
        self.itls += it.inter_token_latencies
        for f in it.finished_requests:
            self.num_finished += 1
            self.e2e_latencies.append(f.e2e_latency)
            self.queue_times.append(f.queue_time)
        if sched_stats is not None:
            self.last_scheduler_stats = sched_stats
            self.max_kv_cache_usage = max(self.max_kv_cache_usage, sched_stats.kv_cache_usage)
        for k, v in timings.items():
            self.step_time_s[k] = self.step_time_s.get(k, 0.0) + v

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start_time

    @property
    def prefix_cache_hit_rate(self) -> float:
        s = self.last_scheduler_stats
        return s.prefix_cache_hits / s.prefix_cache_queries if s and s.prefix_cache_queries else 0.0

    def summary(self) -> dict[str, float | None]:
        el = max(self.elapsed, 1e-9)
        s = self.last_scheduler_stats
        return {
            "requests_finished": self.num_finished,
            "prompt_tok_per_s": self.num_prompt_tokens / el,
            "output_tok_per_s": self.num_generation_tokens / el,
            "ttft_p50_s": percentile(self.ttfts, 50), "ttft_p99_s": percentile(self.ttfts, 99),
            "itl_p50_s": percentile(self.itls, 50), "itl_p99_s": percentile(self.itls, 99),
            "e2e_p50_s": percentile(self.e2e_latencies, 50),
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "kv_cache_usage_max": self.max_kv_cache_usage,
            "num_preemptions": s.num_preemptions if s else 0,
        }


class LoggingStatLogger:
    """Logs throughput and queue state every `interval_s` seconds (vLLM's format, roughly)."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last = time.monotonic()
        self._prompt = self._gen = 0

    def record(self, it: IterationStats, sched_stats) -> None:
        self._prompt += it.num_prompt_tokens
        self._gen += it.num_generation_tokens
        now = time.monotonic()
        if now - self._last < self.interval_s or sched_stats is None:
            return
        dt, s = now - self._last, sched_stats
        hit = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%, Preemptions: %d", self._prompt / dt,
                    self._gen / dt, s.num_running_reqs, s.num_waiting_reqs,
                    100 * s.kv_cache_usage, 100 * hit, s.num_preemptions)
        self._last, self._prompt, self._gen = now, 0, 0
