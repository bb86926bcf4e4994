"""Verify scheduled drafts in the engine: target logits -> accepted tokens.

vLLM counterpart: the spec-decode branch of `GPUModelRunner.execute_model`
(`vllm/v1/worker/gpu_model_runner.py`) calling `RejectionSampler`
(`vllm/v1/sample/rejection_sampler.py`).

A request with k scheduled drafts owns k + 1 logits rows (one per draft
position, then the bonus row). Chapter 4's `RejectionSampler` turns them into
1..k+1 emitted tokens with the same temperature / top-k / top-p processing the
plain sampler uses; drafts come without probabilities (greedy proposals).
Which requests may get drafts at all is `spec_eligible`.
"""
from __future__ import annotations

import torch

from mini_vllm.spec_decode import PLACEHOLDER_TOKEN_ID, RejectionSampler, SpecDecodeMetadata
from mini_vllm.spec_decode import SamplingMetadata as SpecSamplingMetadata

_SAMPLING_EPS = 1e-5


def spec_eligible(params) -> bool:
    """Drafts only for requests whose processing Chapter 4's sampler reproduces
    exactly: no penalties, min_p, min_tokens, logprobs, logit_bias,
    allowed_token_ids, bad_words or structured outputs, and no seed (a seeded
    request must give the same tokens with and without speculation, and
    verification consumes random numbers differently)."""
    return (getattr(params, "seed", None) is None and getattr(params, "logprobs", None) is None
            and getattr(params, "min_p", 0.0) == 0.0 and getattr(params, "min_tokens", 0) == 0
            and getattr(params, "presence_penalty", 0.0) == 0.0
            and getattr(params, "frequency_penalty", 0.0) == 0.0
            and getattr(params, "repetition_penalty", 1.0) == 1.0
            # Token controls and grammars shape each row before sampling; verification
            # would need them on every draft row, so such requests decode without drafts.
            and not getattr(params, "logit_bias", None) and not getattr(params, "allowed_token_ids", None)
            and not getattr(params, "bad_words", None)
            and getattr(params, "structured_outputs", None) is None)


class SpecVerifier:
    def __init__(self, device) -> None:
        self.sampler = RejectionSampler("triton" if torch.device(device).type == "cuda" else "torch")
        self.num_drafts = 0
        self.num_accepted = 0
        self.accepted_per_position: list[int] = []
        self.drafts_per_position: list[int] = []

    def verify(self, logits: torch.Tensor, drafts: list[list[int]], params: list) -> list[list[int]]:
        """logits [sum(k_i + 1), V] in request order; returns the emitted tokens per request."""
        meta = SpecDecodeMetadata.make(drafts, logits.device)
        temp = [0.0 if p.temperature < _SAMPLING_EPS else float(p.temperature) for p in params]
        sampling = SpecSamplingMetadata.make(temp, [int(p.top_k) for p in params],
                                             [float(p.top_p) for p in params])
        out = self.sampler(meta, None, logits, sampling).tolist()
        emitted = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out]
        for d, e in zip(drafts, emitted):
            a = len(e) - 1  # accepted drafts; the last token is a recovery or the bonus
            self.num_drafts += len(d)
            self.num_accepted += a
            while len(self.drafts_per_position) < len(d):
                self.drafts_per_position.append(0)
                self.accepted_per_position.append(0)
            for j in range(len(d)):
                self.drafts_per_position[j] += 1
                self.accepted_per_position[j] += j < a
        return emitted
