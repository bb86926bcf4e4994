"""Sampling operators (vLLM: `vllm/v1/sample/ops/`)."""
