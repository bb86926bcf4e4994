"""Prefix-cache counters.

vLLM counterpart: `PrefixCacheStats` in `vllm/v1/metrics/stats.py` (and
`PrefixCachingMetrics` in `vllm/v1/core/kv_cache_utils.py`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """`queries` counts tokens looked up (whole prompts), `hits` tokens found.

    Invariant: 0 <= hits <= queries. Because the last prompt token is always
    recomputed, a request's hits are at most num_tokens - 1.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.requests = self.queries = self.hits = 0
