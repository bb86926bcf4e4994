"""Speculative decoding inside the engine (vLLM: `vllm/v1/spec_decode/` and
`vllm/config/speculative.py`): `config.SpeculativeConfig`, `proposers.DraftModelProposer`
(built on Chapter 4's `mini_vllm.spec_decode`, whose `NgramProposer` the engine uses as
is), and `verifier` (drafts checked by the rejection sampler). Named `speculative`
because `mini_vllm.spec_decode` is Chapter 4."""
