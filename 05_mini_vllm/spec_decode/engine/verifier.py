"""Verify scheduled drafts in the engine: target logits -> accepted tokens.

vLLM counterpart: the spec-decode branch of `GPUModelRunner.execute_model`
(`vllm/v1/worker/gpu_model_runner.py`) calling `RejectionSampler`
(`vllm/v1/sample/rejection_sampler.py`).

A request with k scheduled drafts owns k + 1 logits rows (one per draft
position, then the bonus row). Chapter 4's `RejectionSampler` turns them into
1..k+1 emitted tokens. Its probabilities come from `compute_probs` below: the
engine sampler's temperature and top-k / top-p (`mini_vllm.sample.ops.topk_topp`,
ties at the k-th logit kept), read from the engine's own `SamplingMetadata`,
so a request's tokens follow one distribution whether a step verifies drafts
or samples plainly. Drafts come without probabilities (greedy proposals).
Which requests may get drafts at all is `spec_eligible`.
"""
from __future__ import annotations

import copy

import torch

from mini_vllm.metrics.stats import SpecDecodingStats
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sample.sampler import greedy_argmax
from mini_vllm.sample.ops.topk_topp import apply_top_k_top_p
from mini_vllm.sample.param_effects import verifier_reproduces
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.spec_decode import PLACEHOLDER_TOKEN_ID, RejectionSampler, SpecDecodeMetadata


def spec_eligible(params: SamplingParams) -> bool:
    """Drafts only for requests whose processing the verifier reproduces exactly
    (temperature, top-k, top-p, and parameters that do not touch the distribution):
    no penalties, min_p, min_tokens, logprobs, logit_bias, allowed_token_ids,
    bad_words, structured outputs or seed. Which parameter is which is declared once,
    for every field, in `mini_vllm.sample.param_effects`."""
    return verifier_reproduces(params)


def compute_probs(logits: torch.Tensor, sampling: SamplingMetadata, rows_per_request=None) -> torch.Tensor:
    """Chapter 4's `logits_to_probs` contract with the engine sampler's processing.

    logits [n, V]; rows_per_request [B]: consecutive rows per request (default
    one each). Returns float32 probabilities [n, V]: temperature, then top-k /
    top-p as `Sampler` applies them. Greedy rows (temperature 0.0, filters
    disabled by `SamplingParams`) get the softmax of the raw logits, whose
    argmax is all that greedy verification reads.
    """
    device = logits.device
    rows = torch.ones(sampling.batch_size, dtype=torch.int64) if rows_per_request is None else rows_per_request
    rows = torch.as_tensor(rows, dtype=torch.int64).to(device)

    def per_row(t):
        return None if t is None else t.to(device).repeat_interleave(rows)

    temp = per_row(sampling.temperature)
    logits = logits.float() / torch.where(temp == 0.0, 1.0, temp).unsqueeze(1)
    if sampling.top_k is not None or sampling.top_p is not None:
        logits = apply_top_k_top_p(logits, per_row(sampling.top_k), per_row(sampling.top_p))
    return logits.softmax(dim=-1)


class SpecVerifier:
    def __init__(self, device) -> None:
        self.sampler = RejectionSampler("triton" if torch.device(device).type == "cuda" else "torch",
                                        compute_probs=compute_probs)
        self.totals = SpecDecodingStats()  # every draft sequence verified since the start

    def verify(self, logits: torch.Tensor, drafts: list[list[int]], sampling: SamplingMetadata) -> list[list[int]]:
        """logits [sum(k_i + 1), V] in request order, `sampling` one row per request;
        returns the emitted tokens per request."""
        if bool(sampling.is_greedy.all()):
            emitted = self._verify_greedy(logits, drafts)
        else:
            meta = SpecDecodeMetadata.make(drafts, logits.device)
            out = self.sampler(meta, None, logits, sampling, sampling.generators).tolist()
            emitted = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out]
        for d, e in zip(drafts, emitted):
            if d:  # the last emitted token is a recovery or the bonus, the rest accepted drafts
                self.totals.observe_draft(len(d), len(e) - 1)
        return emitted

    @staticmethod
    def _verify_greedy(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
        """Every request greedy: one argmax per row, then the rule on the host. A request
        keeps its drafts up to the first one that is not its row's argmax and then emits
        that row's argmax (the bonus row's after k accepted drafts). vLLM's
        `rejection_sample` returns the same way once its greedy kernel has run, before
        any softmax; the rejection sampler gives these tokens too, at about 0.8 ms a step
        of one request at batch 1 (softmax, draws and its batched rule, some sixty small
        tensor ops) where this takes a few microseconds. The argmax is the engine
        sampler's (`greedy_argmax`: first index on a tie), so a greedy request gets the
        same token whether a step verifies drafts or samples plainly."""
        rows = sum(len(d) + 1 for d in drafts)  # the rejection sampler checks this on its own path
        if logits.dim() != 2 or logits.shape[0] != rows:
            raise ValueError(f"logits must be [sum(k_i + 1) = {rows}, vocab], got {tuple(logits.shape)}")
        best = greedy_argmax(logits).tolist()
        out, row = [], 0
        for d in drafts:
            n = 0
            while n < len(d) and d[n] == best[row + n]:
                n += 1
            out.append(list(d[:n]) + [best[row + n]])
            row += len(d) + 1
        return out

    def stats(self) -> SpecDecodingStats:
        """The counters so far, as the metrics record (a copy: the caller may keep it)."""
        return copy.deepcopy(self.totals)
