"""The verify step around a rejection sampler: logits in, emitted tokens out.

vLLM counterpart: `RejectionSampler.forward` in
`vllm/v1/sample/rejection_sampler.py`. This class holds the pipeline only:
target (and draft) logits -> processed probabilities (`sampling.py`) -> the
randomness drawn in a fixed order per seeded request (`random_draws.py`) ->
a sampler -> tokens. The sampler rules themselves (accept, recover, bonus)
plug in as `per_request_sampler`, `batched_sampler` and `triton_sampler`:
`rejection_sampler.RejectionSampler` sets the reference ones, the exercise its
own, so the end-to-end tests run whichever is under test.

The logits -> probabilities step plugs in too (`compute_probs=`, Chapter 4's
`sampling.logits_to_probs` by default). Verification is lossless for the
distribution this step computes, so an engine passes its own sampler's
processing: a request's tokens then follow one distribution whether a step
verifies drafts or samples plainly (Chapter 5 passes
`spec_decode.engine.verifier.compute_probs`, vLLM's name, built on
`mini_vllm.sample.ops.topk_topp`). `sampling` is whatever that function
reads, plus `is_greedy` [B] and `validate(batch)`.
"""
from __future__ import annotations

import torch

from mini_vllm.scheduler.request import PLACEHOLDER_TOKEN_ID  # pads the output after the emitted tokens

from .random_draws import generate_exponential_noise, generate_uniform_probs
from .sampling import logits_to_probs, sample_from_probs
BACKENDS = ("reference", "torch", "triton")


class RejectionSamplerPipeline:
    """backend: "reference" (per-request loop), "torch" (batched) or "triton"."""

    # Each: (draft_token_ids, num_draft_tokens, draft_probs, target_probs, bonus_token_ids,
    # is_greedy, uniform_probs, recovery_noise) -> [B, max_k + 1] int64 (rejection_sampler.py's
    # contract); a subclass sets them (staticmethod), None means the backend is not available.
    per_request_sampler = None
    batched_sampler = None
    triton_sampler = None

    def __init__(self, backend: str = "torch", compute_probs=logits_to_probs):
        """compute_probs(logits [n, V], sampling, rows_per_request=None) -> float32 [n, V]:
        the temperature / top-k / top-p processing (see `sampling.logits_to_probs`)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be 'reference', 'torch' or 'triton', got {backend!r}")
        sampler = {"reference": self.per_request_sampler, "torch": self.batched_sampler,
                   "triton": self.triton_sampler}[backend]
        if sampler is None:
            raise ValueError(f"backend {backend!r} has no sampler in {type(self).__name__}")
        self.backend = backend
        self.compute_probs = compute_probs

    def __call__(self, metadata, draft_probs, target_logits, sampling, generators=None, draft_logits=None):
        """metadata: SpecDecodeMetadata; target_logits [sum(k_b + 1), V] (drafts then bonus row per
        request); draft_probs [T, V] or None; or draft_logits [T, V], which get the same
        temperature/top-k/top-p processing as the target. Returns [B, max_k + 1] int64."""
        num = metadata.num_draft_tokens
        batch, vocab = num.shape[0], target_logits.shape[-1]
        sampling.validate(batch)
        if target_logits.dim() != 2 or target_logits.shape[0] != int(num.sum()) + batch:
            raise ValueError(
                f"target_logits must be [sum(num_draft_tokens + 1) = {int(num.sum()) + batch}, vocab], "
                f"got {tuple(target_logits.shape)}"
            )
        all_greedy = bool(sampling.is_greedy.all())
        if draft_logits is not None:
            if draft_probs is not None:
                raise ValueError("pass draft_probs or draft_logits, not both")
            # Greedy verification never reads q, so an all-greedy batch skips it.
            draft_probs = None if all_greedy else self.compute_probs(draft_logits, sampling, num)
        target_probs = self.compute_probs(target_logits[metadata.target_logits_indices], sampling, num)
        device = target_logits.device
        is_greedy = sampling.is_greedy.to(device)
        if all_greedy:
            # Greedy needs argmaxes only: no random draws, no bonus softmax.
            uniform = torch.zeros(int(num.sum()), dtype=torch.float32, device=device)
            recovery_noise = torch.ones(batch, vocab, dtype=torch.float32, device=device)
            bonus = target_logits[metadata.bonus_logits_indices].argmax(-1)
        else:
            bonus_probs = self.compute_probs(target_logits[metadata.bonus_logits_indices], sampling)
            # Fixed draw order per seeded request: uniforms, recovery noise, bonus noise.
            uniform = generate_uniform_probs(num.tolist(), generators, device)
            recovery_noise = generate_exponential_noise(batch, vocab, generators, device)
            bonus_noise = generate_exponential_noise(batch, vocab, generators, device)
            bonus = torch.where(is_greedy, bonus_probs.argmax(-1), sample_from_probs(bonus_probs, bonus_noise))
        args = (metadata.draft_token_ids, num, draft_probs, target_probs, bonus, is_greedy, uniform, recovery_noise)
        if self.backend == "reference":
            return self.per_request_sampler(*args)
        if self.backend == "torch":
            return self.batched_sampler(*args)
        return self.triton_sampler(*args)
