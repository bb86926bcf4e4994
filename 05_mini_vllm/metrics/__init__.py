"""Engine statistics (vLLM: `vllm/v1/metrics/`): `stats` (the stats types),
`loggers` (accumulating and periodic loggers), `prometheus` (the server's /metrics)."""
