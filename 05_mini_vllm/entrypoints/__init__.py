"""Entry points (vLLM: `vllm/entrypoints/`): `llm.LLM` (the offline API),
`cli` (`python -m mini_vllm generate|serve`), and `openai/` (the
OpenAI-compatible HTTP server)."""
