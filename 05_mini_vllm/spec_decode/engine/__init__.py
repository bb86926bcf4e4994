"""Speculative decoding inside the engine (vLLM: `vllm/v1/spec_decode/` and
`vllm/config/speculative.py`): `config.SpeculativeConfig`, `proposers.DraftModelProposer`,
the EAGLE proposer (`eagle.py`) and `verifier` (drafts checked by the rejection sampler).

Chapter 5's part of `mini_vllm.spec_decode`, whose top level is Chapter 4 (the rejection
sampler and the proposers the engine builds on; its `NgramProposer` runs here as is): one
package for the concept, as vLLM's `vllm/v1/spec_decode/`. The folder sits in Chapter 5
(pyproject maps it); Chapter 4's modules never import it."""
