"""Executors (vLLM: `vllm/v1/executor/`): `abstract.Executor` is the interface the
engine core uses; `uniproc_executor` runs one worker in this process,
`multiproc_executor` one worker per tensor-parallel rank."""
