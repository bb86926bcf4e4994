"""Draft proposers: who guesses the k tokens that the target then verifies.

vLLM counterparts: `vllm/v1/spec_decode/ngram_proposer.py` (the n-gram
proposer) and `draft_model.py` / `eagle.py` (model-based proposers).

- `NgramProposerBase`: the plumbing of a prompt-lookup proposer (argument
  checks, one context per request); the lookup itself, `propose_ngram`, is
  plugged in by `ngram_proposer.NgramProposer` (or by the exercise).
- `NextTokenModelProposer`: any callable that maps contexts to next-token
  logits drafts k tokens autoregressively, with the *same* sampling
  processing as the target (`sampling.logits_to_probs`), and returns the
  draft probabilities the rejection sampler needs. It is the loop of a
  draft-model proposer without the model: Chapter 5's
  `spec_decode.engine.proposers.DraftModelProposer` (vLLM's `DraftModelProposer`)
  subclasses it with a real small model on its own paged KV cache.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .sampling import TemperatureTopKTopP, logits_to_probs, sample_from_probs


class NgramProposerBase:
    """Prompt-lookup proposer, one context per request; `_propose(tokens, min_n,
    max_n, k)` is the lookup, set by a subclass."""

    _propose = None

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


class NextTokenModelProposer:
    """Draft k tokens with any next-token model, sampling exactly as the target does.

    The model is called k times on the growing contexts (no KV cache here;
    Chapter 5's `spec_decode.engine.proposers.DraftModelProposer` plugs in a real
    small model with its own paged cache). Greedy requests take the argmax,
    others sample with their own generator when one is given; an all-greedy
    batch draws no random numbers.
    """

    def __init__(self, model: NextTokenModel, k: int = 4):
        if k < 1:
            raise ValueError(f"k (num_speculative_tokens) must be >= 1, got {k}")
        self.model, self.k = model, k

    def propose(
        self, contexts: Sequence[Sequence[int]], sampling: TemperatureTopKTopP, generators: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (draft_token_ids [B, k] int64, draft_probs [B, k, V] float32)."""
        batch = len(contexts)
        sampling.validate(batch)
        ctx = [list(c) for c in contexts]
        all_greedy = bool(sampling.is_greedy.all())
        tokens, probs = [], []
        for _ in range(self.k):
            logits = self.model(ctx)
            if logits.dim() != 2 or logits.shape[0] != batch:
                raise ValueError(f"draft model must return logits [batch={batch}, vocab], got {tuple(logits.shape)}")
            p = logits_to_probs(logits, sampling)
            if all_greedy:  # argmaxes only: no noise drawn, the global generator is left alone
                tok = p.argmax(-1)
            else:
                noise = torch.empty_like(p).exponential_()
                for i, g in (generators or {}).items():
                    noise[i].exponential_(generator=g)
                tok = torch.where(sampling.is_greedy.to(p.device), p.argmax(-1), sample_from_probs(p, noise))
            tokens.append(tok)
            probs.append(p)
            for c, t in zip(ctx, tok.tolist()):
                c.append(t)
        return torch.stack(tokens, 1), torch.stack(probs, 1)
