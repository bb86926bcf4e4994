"""Attention backends of the engine (vLLM: `vllm/v1/attention/backends/` and
`vllm/attention/selector.py`): `backends` (torch, triton, cpu, and the selector),
`torch_attn` (the readable PyTorch path), `metadata.AttentionMetadata`."""
