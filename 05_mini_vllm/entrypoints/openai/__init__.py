"""The OpenAI-compatible server (vLLM: `vllm/entrypoints/openai/`): `api_server`
(FastAPI app under uvicorn), `protocol` (request and response models),
`serving_completion` / `serving_chat` (API requests to engine requests through
`mini_vllm.engine.async_llm.AsyncLLM`), `cli_args`."""
