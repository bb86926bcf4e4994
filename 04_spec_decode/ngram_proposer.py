"""The n-gram (prompt-lookup) proposer: drafts copied from the context itself.

vLLM counterpart: `vllm/v1/spec_decode/ngram_proposer.py` (`NgramProposer`).
If the last n tokens of the context appeared earlier, guess that what followed
them then follows again. No model at all; its drafts carry no probabilities,
so the rejection sampler uses the one-hot q rule.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .proposers import NgramProposerBase


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


class NgramProposer(NgramProposerBase):
    """Prompt-lookup proposer, one context per request."""

    _propose = staticmethod(propose_ngram)
