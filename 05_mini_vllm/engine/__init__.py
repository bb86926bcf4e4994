"""The engine (vLLM: `vllm/v1/engine/`): `llm_engine.LLMEngine` (requests in, outputs
out), `core.EngineCore` (scheduler + executor, one step), `processor` (a prompt
validated once), `output_processor` and `detokenizer` (tokens to text, stop
strings), `async_llm` / `async_stream` (the asyncio front end of the server)."""
