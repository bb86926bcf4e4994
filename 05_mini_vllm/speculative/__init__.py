"""Speculative decoding inside the engine (vLLM: `vllm/v1/spec_decode/` and
`vllm/config/speculative.py`): `config.SpeculativeConfig`, the proposers (built on
Chapter 4's `mini_vllm.spec_decode`), and `verifier` (drafts checked by the
rejection sampler). Named `speculative` because `mini_vllm.spec_decode` is Chapter 4."""
