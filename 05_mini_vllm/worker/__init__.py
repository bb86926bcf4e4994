"""The worker side (vLLM: `vllm/v1/worker/`): `worker.Worker` (model, KV budget,
cache), `model_runner.ModelRunner` (persistent batch, inputs, forward, sample),
`input_batch`, `prepare_inputs`, `cache_engine`."""
