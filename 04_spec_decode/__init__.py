"""Chapter 4: speculative decoding (rejection sampler and draft proposers).

Public API (also exposed, partly as stubs, by `mini_vllm.spec_decode.exercise`).
The subpackage `mini_vllm.spec_decode.engine` is Chapter 5's (the engine's config,
proposers and verifier, in 05_mini_vllm/spec_decode/engine/); nothing here imports it.
"""
# Absolute imports on purpose: pytest --nbmake imports this file as a top-level
# module when it collects the chapter's notebook ("04_spec_decode" is not a
# valid package name), and relative imports would fail there.
from mini_vllm.spec_decode.metadata import SpecDecodeMetadata, apply_verify_step, num_accepted_from_output
from mini_vllm.spec_decode.ngram_proposer import NgramProposer, propose_ngram
from mini_vllm.spec_decode.proposers import NextTokenModelProposer
from mini_vllm.spec_decode.random_draws import generate_exponential_noise, generate_uniform_probs
from mini_vllm.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    recover_token,
    rejection_sample,
    rejection_sample_reference,
    rejection_sample_request,
)
from mini_vllm.spec_decode.sampling import (
    TemperatureTopKTopP,
    apply_top_k_top_p_pytorch,
    logits_to_probs,
    sample_from_probs,
)
from mini_vllm.spec_decode.validation import validate_rejection_inputs

__all__ = [
    "PLACEHOLDER_TOKEN_ID", "NextTokenModelProposer", "NgramProposer", "RejectionSampler", "SpecDecodeMetadata",
    "TemperatureTopKTopP", "apply_top_k_top_p_pytorch", "apply_verify_step", "generate_exponential_noise",
    "generate_uniform_probs", "logits_to_probs", "num_accepted_from_output", "propose_ngram", "recover_token",
    "rejection_sample", "rejection_sample_reference", "rejection_sample_request", "sample_from_probs",
    "validate_rejection_inputs",
]
