"""Prometheus metrics of the server (`GET /metrics`), under vLLM's names.

vLLM counterpart: `vllm/v1/metrics/loggers.py` (`PrometheusStatLogger`) and
the `/metrics` route of `vllm/entrypoints/openai/api_server.py`.

The engine thread calls `record(StepStats)` after every step or abort;
`prometheus_client` metrics are thread-safe, so the event loop can render
them at any time. Each logger owns its own `CollectorRegistry`, so two
servers in one process (tests) never share counters.

- histograms: `vllm:time_to_first_token_seconds`,
  `vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`
- gauges: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (a fraction in [0, 1], as in vLLM)
- counters: `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`
  (tokens), `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class PrometheusStatLogger:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        lbl, v = ["model_name"], [model_name]

        def hist(name, doc, buckets):
            return Histogram(name, doc, lbl, buckets=buckets, registry=r).labels(*v)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency", _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                        _LATENCY_BUCKETS)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", lbl,
                             registry=r).labels(*v)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", lbl,
                             registry=r).labels(*v)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", lbl,
                              registry=r).labels(*v)

        def counter(name, doc):  # prometheus_client adds the `_total` suffix
            return Counter(name, doc, lbl, registry=r).labels(*v)

        self.pc_queries = counter("vllm:prefix_cache_queries", "Prefix-cache lookups, in tokens")
        self.pc_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens computed")
        self.gen_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self._last = (0, 0, 0)  # the scheduler's cumulative queries, hits, preemptions

    def record(self, st) -> None:
        s = st.scheduler_stats
        if s is not None:
            self.running.set(s.num_running_reqs)
            self.waiting.set(s.num_waiting_reqs)
            self.kv_usage.set(s.kv_cache_usage)
            q, h, p = s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions
            self.pc_queries.inc(max(0, q - self._last[0]))
            self.pc_hits.inc(max(0, h - self._last[1]))
            self.preemptions.inc(max(0, p - self._last[2]))
            self._last = (q, h, p)
        self.prompt_tokens.inc(st.num_prompt_tokens)
        self.gen_tokens.inc(st.num_generation_tokens)
        for x in st.ttfts:
            self.ttft.observe(x)
        for x in st.itls:
            self.itl.observe(x)
        for x in st.e2e_latencies:
            self.e2e.observe(x)

    def render(self) -> bytes:
        return generate_latest(self.registry)
