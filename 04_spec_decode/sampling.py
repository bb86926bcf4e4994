"""Sampling processing shared by the target and the draft: temperature, top-k, top-p.

vLLM counterpart: `vllm/v1/sample/ops/topk_topp_sampler.py` (top-k/top-p masks,
`apply_top_k_top_p_pytorch`) and the temperature step of
`vllm/v1/sample/rejection_sampler.py` (`apply_sampling_constraints`).
`TemperatureTopKTopP` holds only what verification reads; the engine's
`mini_vllm.sample.metadata.SamplingMetadata` (vLLM's) holds the whole
sampler's state. `logits_to_probs` is the processing on it; the engine's
`spec_decode.engine.verifier.compute_probs` has the same contract on the engine's
metadata and filters.

Speculative decoding is lossless only for the distribution that *both* sides
verify against, so the exact same processing must turn target logits and draft
logits into probabilities. Everything here is per request (one row of
`temperature`, `top_k`, `top_p` per request) and vectorised over rows.

Conventions (invariants):
- `temperature == 0` marks a greedy request. Its probabilities are the plain
  softmax of the raw logits (temperature 1, no top-k/top-p), whose argmax is
  the greedy token.
- `top_k == 0` or `top_k >= vocab` disables top-k; `top_p == 1.0` disables top-p.
- The most likely token always survives both filters, so every row stays a
  distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 0.0


@dataclass
class TemperatureTopKTopP:
    """Per-request temperature, top-k and top-p (all tensors of shape [batch]): the
    sampling parameters that speculative decoding reproduces on both sides."""

    temperature: torch.Tensor  # float32, 0 = greedy
    top_k: torch.Tensor  # int64, 0 = disabled
    top_p: torch.Tensor  # float32, 1.0 = disabled

    @classmethod
    def make(cls, temperature, top_k=None, top_p=None) -> "TemperatureTopKTopP":
        temperature = torch.as_tensor(temperature, dtype=torch.float32).reshape(-1)
        n = temperature.shape[0]
        top_k = torch.zeros(n, dtype=torch.int64) if top_k is None else torch.as_tensor(top_k, dtype=torch.int64).reshape(-1)
        top_p = torch.ones(n, dtype=torch.float32) if top_p is None else torch.as_tensor(top_p, dtype=torch.float32).reshape(-1)
        meta = cls(temperature, top_k, top_p)
        meta.validate()
        return meta

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperature == GREEDY_TEMPERATURE

    def validate(self, batch_size: int | None = None) -> None:
        n = self.temperature.shape[0]
        for name in ("top_k", "top_p"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name} must have shape ({n},) like temperature, got {tuple(getattr(self, name).shape)}")
        if batch_size is not None and n != batch_size:
            raise ValueError(f"sampling metadata has {n} requests but the batch has {batch_size}")
        if not torch.isfinite(self.temperature).all() or (self.temperature < 0).any():
            raise ValueError("temperature must be finite and >= 0 (0 means greedy)")
        if (self.top_k < 0).any():
            raise ValueError("top_k must be >= 0 (0 disables top-k)")
        if ((self.top_p <= 0) | (self.top_p > 1)).any():
            raise ValueError("top_p must lie in (0, 1] (1 disables top-p)")


def apply_top_k_top_p_pytorch(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p set to -inf, with one full sort.

    vLLM's name for its sort-based fallback; the engine's `apply_top_k_top_p`
    (`mini_vllm.sample.ops.topk_topp`) avoids the full sort and keeps ties.

    logits [n, V]; top_k, top_p [n]. The top-p set is the smallest prefix of the
    sorted tokens whose probability mass reaches top_p (computed after top-k).
    Ties at the k-th value are broken by sort order, so exactly k tokens stay.
    """
    n, vocab = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).expand(n, vocab)
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).to(logits.device)
    drop = rank >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Mass strictly before each token; a token is kept while that mass < top_p,
    # which keeps rank 0 always and stops right after the prefix reaches top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.to(logits.device).unsqueeze(1)
    drop[:, 0] = False
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, masked_sorted)


def logits_to_probs(logits: torch.Tensor, sampling: TemperatureTopKTopP, rows_per_request=None) -> torch.Tensor:
    """Processed probabilities [n, V] (float32) from logits [n, V].

    rows_per_request [batch] says how many consecutive logits rows belong to
    each request (a request with k drafts owns k rows); default one row each.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}")
    batch = sampling.temperature.shape[0]
    if rows_per_request is None:
        rows_per_request = torch.ones(batch, dtype=torch.int64)
    rows_per_request = torch.as_tensor(rows_per_request, dtype=torch.int64)
    if rows_per_request.shape != (batch,) or int(rows_per_request.sum()) != logits.shape[0]:
        raise ValueError(
            f"rows_per_request must have {batch} entries summing to logits rows {logits.shape[0]}, "
            f"got {rows_per_request.tolist()}"
        )
    rows_per_request = rows_per_request.to(logits.device)
    expand = lambda t: t.to(logits.device).repeat_interleave(rows_per_request)  # noqa: E731
    temp = expand(sampling.temperature)
    greedy = temp == GREEDY_TEMPERATURE
    temp = torch.where(greedy, 1.0, temp)
    top_k = torch.where(greedy, 0, expand(sampling.top_k))
    top_p = torch.where(greedy, 1.0, expand(sampling.top_p))
    logits = logits.float() / temp.unsqueeze(1)
    # The full sort in apply_top_k_top_p_pytorch dominates the cost; skip it when
    # no row filters (every all-greedy batch, and plain temperature sampling).
    if bool((((top_k > 0) & (top_k < logits.shape[-1])) | (top_p < 1.0)).any()):
        logits = apply_top_k_top_p_pytorch(logits, top_k, top_p)
    return logits.softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample one token per row with the exponential race: argmax(p / E), E ~ Exp(1).

    P(argmax = v) = p[v] / sum(p), so this is exact categorical sampling, and it
    is deterministic given the noise tensor, which lets several implementations
    be compared on identical draws.
    """
    return (probs / noise).argmax(dim=-1)
