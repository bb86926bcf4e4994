"""Serving the engine over HTTP with the OpenAI API (vLLM: `vllm/entrypoints/`).

`api_server` builds the FastAPI app and runs it under uvicorn; `protocol`
holds the request/response models; `serving_completion` and `serving_chat`
turn API requests into engine requests through `mini_vllm.async_llm.AsyncLLM`;
`metrics` exports Prometheus metrics.
"""
