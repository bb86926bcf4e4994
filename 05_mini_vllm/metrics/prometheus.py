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
  `vllm:generation_tokens_total`, `vllm:request_success_total` (by
  `finished_reason`: stop, length, abort)
- per finished request (histograms): `vllm:request_prompt_tokens`,
  `vllm:request_generation_tokens`, `vllm:request_max_num_generation_tokens`,
  `vllm:request_params_n`, `vllm:request_params_max_tokens`,
  `vllm:request_queue_time_seconds`, `vllm:request_prefill_time_seconds`,
  `vllm:request_decode_time_seconds`, `vllm:request_inference_time_seconds`,
  `vllm:request_time_per_output_token_seconds`
- per step: `vllm:iteration_tokens_total` (histogram of tokens per step)
- `vllm:cache_config_info` (a gauge at 1 whose labels describe the KV cache)
- with speculative decoding only (`num_spec_tokens` given, as vLLM registers
  them only with a `speculative_config`), counters fed by each step's
  `SpecDecodingStats`: `vllm:spec_decode_num_drafts_total` (draft sequences:
  request-steps that verified drafts), `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total` and
  `vllm:spec_decode_num_accepted_tokens_per_pos_total` (label `position`,
  0 .. k - 1). Mean acceptance length = 1 + accepted / drafts.
vLLM series left out (nothing here computes them): LoRA, multimodal cache,
external (KV connector) prefix-cache counters,
waiting-by-reason, per-request preemptions, cached prompt tokens by source,
KV block lifetime / idle / reuse histograms, sleep state, corrupted requests.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from mini_vllm.metrics.stats import StepStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_REQUEST_TIME_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0,
                         480.0, 960.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 500000
_N_BUCKETS = (1, 2, 5, 10, 20)
_FINISH_REASONS = ("stop", "length", "abort")


class PrometheusStatLogger:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, num_spec_tokens: int | None = None) -> None:
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
        self.spec = None  # (drafts, draft tokens, accepted tokens, accepted per position)
        if num_spec_tokens:
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position",
                              ["model_name", "position"], registry=r)
            self.spec = (counter("vllm:spec_decode_num_drafts", "Draft sequences verified"),
                         counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified"),
                         counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted"),
                         [per_pos.labels(model_name, str(j)) for j in range(num_spec_tokens)])
        success = Counter("vllm:request_success", "Finished requests, by finish reason",
                          ["model_name", "finished_reason"], registry=r)
        self.success = {f: success.labels(model_name, f) for f in _FINISH_REASONS}
        per_request = [("request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS),
                       ("request_generation_tokens", "Generated tokens per request (all n samples)", _TOKEN_BUCKETS),
                       ("request_max_num_generation_tokens", "Tokens of the longest sample", _TOKEN_BUCKETS),
                       ("request_params_n", "The n of each request", _N_BUCKETS),
                       ("request_params_max_tokens", "The max_tokens of each request", _TOKEN_BUCKETS),
                       ("request_queue_time_seconds", "Arrival to first schedule", _REQUEST_TIME_BUCKETS),
                       ("request_prefill_time_seconds", "First schedule to first token", _REQUEST_TIME_BUCKETS),
                       ("request_decode_time_seconds", "First token to last token", _REQUEST_TIME_BUCKETS),
                       ("request_inference_time_seconds", "First schedule to last token", _REQUEST_TIME_BUCKETS),
                       ("request_time_per_output_token_seconds", "Mean time per output token after the first",
                        _TPOT_BUCKETS)]
        self.per_request = {name: hist(f"vllm:{name}", doc, b) for name, doc, b in per_request}
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Tokens (prompt + generated) per engine step",
                                     _TOKEN_BUCKETS)
        self._model_name = model_name

    def set_cache_config_info(self, **info) -> None:
        """vLLM's `vllm:cache_config_info`: value 1, the configuration in the labels."""
        g = Gauge("vllm:cache_config_info", "KV cache configuration", sorted(info), registry=self.registry)
        g.labels(**{k: str(v) for k, v in info.items()}).set(1)

    def record(self, st: StepStats) -> None:
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
        for f in st.finished:
            if f.finish_reason in self.success:
                self.success[f.finish_reason].inc()
            h = self.per_request
            for name, value in (("request_prompt_tokens", f.num_prompt_tokens),
                                ("request_generation_tokens", f.num_generation_tokens),
                                ("request_max_num_generation_tokens", f.max_num_generation_tokens),
                                ("request_params_n", f.n), ("request_params_max_tokens", f.max_tokens),
                                ("request_queue_time_seconds", f.queue_time),
                                ("request_prefill_time_seconds", f.prefill_time),
                                ("request_decode_time_seconds", f.decode_time),
                                ("request_inference_time_seconds", f.inference_time),
                                ("request_time_per_output_token_seconds", f.mean_time_per_output_token)):
                h[name].observe(value)
        for x in st.iteration_tokens:
            self.iteration_tokens.observe(x)
        sd = st.spec_decoding_stats
        if sd is not None and self.spec is not None:  # per-step counts: no running totals to subtract
            drafts, draft_tokens, accepted, per_pos = self.spec
            drafts.inc(sd.num_draft_sequences)
            draft_tokens.inc(sd.num_drafts)
            accepted.inc(sd.num_accepted)
            for c, n in zip(per_pos, sd.accepted_per_position):
                c.inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
