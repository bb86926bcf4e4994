"""Draft proposers: who guesses the k tokens that the target then verifies.

vLLM counterparts: `vllm/v1/spec_decode/ngram_proposer.py` (`NgramProposer`)
and `vllm/v1/spec_decode/draft_model.py` / `eagle.py` (draft-model proposers).

- `NgramProposer` (prompt lookup): no model at all. If the last n tokens of the
  context appeared earlier, guess that what followed them then follows again.
  Its drafts carry no probabilities, so the sampler uses the one-hot q rule.
- `DraftModelProposer`: any callable that maps contexts to next-token logits
  drafts k tokens autoregressively, with the *same* sampling processing as the
  target (`sampling.compute_probs`), and returns the draft probabilities the
  rejection sampler needs.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from .sampling import SamplingMetadata, compute_probs, sample_from_probs


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int,
                  occurrence: str = "earliest") -> list[int]:
    """Prompt-lookup draft for one context.

    For n = max_n down to min_n: find a start i < len - n with
    tokens[i:i+n] == tokens[-n:], and return up to k tokens that followed it,
    tokens[i+n : i+n+k] (fewer if the context ends first). The first n with a
    match wins; no match for any n gives [].

    `occurrence` picks among several matches of the same n: "earliest" (the
    smallest i, vLLM's choice in `vllm/v1/spec_decode/ngram_proposer.py`) or
    "latest" (the largest i). On periodic text the latest match sits one
    period back, so its continuation runs into the end of the context after a
    single period: for [7] * 50 and k = 4, "latest" proposes [7] and
    "earliest" proposes [7, 7, 7, 7].

    Cost: vectorised O(len * n) window comparisons per n (numpy), scanned in
    geometrically growing chunks from the preferred end, so linear in the
    context length and much less when a match sits near that end.
    """
    if min_n < 1 or max_n < min_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if occurrence not in ("earliest", "latest"):
        raise ValueError(f"occurrence must be 'earliest' or 'latest', got {occurrence!r}")
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    if k == 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n :]
        # Candidate starts are 0..length-n-1 (something must follow the match).
        num_starts, done, chunk = length - n, 0, 256
        while done < num_starts:
            size = min(chunk, num_starts - done)
            lo = done if occurrence == "earliest" else num_starts - done - size
            windows = np.lib.stride_tricks.sliding_window_view(arr[lo : lo + size + n - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                i = lo + int(hits[0] if occurrence == "earliest" else hits[-1])
                return arr[i + n : i + n + k].tolist()
            done, chunk = done + size, chunk * 2
    return []


class NgramProposer:
    """Prompt-lookup proposer, one context per request."""

    # Indirection so the exercise can plug in the learner's `propose_ngram`.
    _propose = staticmethod(propose_ngram)

    def __init__(self, min_n: int = 1, max_n: int = 3, k: int = 4):
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if k < 1:
            raise ValueError(f"k (num_speculative_tokens) must be >= 1, got {k}")
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, contexts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Drafts per request (each of length 0..k); draft probabilities are None."""
        return [list(self._propose(c, self.min_n, self.max_n, self.k)) for c in contexts]


# A draft "model": given the batch's contexts, return next-token logits [batch, vocab].
NextTokenModel = Callable[[list[list[int]]], torch.Tensor]


class DraftModelProposer:
    """Draft k tokens with any next-token model, sampling exactly as the target does.

    The model is called k times on the growing contexts (no KV cache here;
    Chapter 5 plugs in a real small model with its own cache). Greedy requests
    take the argmax, others sample with their own generator when one is given.
    """

    def __init__(self, model: NextTokenModel, k: int = 4):
        if k < 1:
            raise ValueError(f"k (num_speculative_tokens) must be >= 1, got {k}")
        self.model, self.k = model, k

    def propose(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingMetadata, generators: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (draft_token_ids [B, k] int64, draft_probs [B, k, V] float32)."""
        batch = len(contexts)
        sampling.validate(batch)
        ctx = [list(c) for c in contexts]
        tokens, probs = [], []
        for _ in range(self.k):
            logits = self.model(ctx)
            if logits.dim() != 2 or logits.shape[0] != batch:
                raise ValueError(f"draft model must return logits [batch={batch}, vocab], got {tuple(logits.shape)}")
            p = compute_probs(logits, sampling)
            noise = torch.empty_like(p).exponential_()
            for i, g in (generators or {}).items():
                noise[i].exponential_(generator=g)
            tok = torch.where(sampling.is_greedy.to(p.device), p.argmax(-1), sample_from_probs(p, noise))
            tokens.append(tok)
            probs.append(p)
            for c, t in zip(ctx, tok.tolist()):
                c.append(t)
        return torch.stack(tokens, 1), torch.stack(probs, 1)
