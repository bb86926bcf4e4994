"""Synthetic request streams and a tiny driver for prefix-cache experiments.

Used by `prefix_caching.ipynb`. The driver feeds requests through the real
`KVCacheManager`: lookup, allocate the uncached prompt tokens, "generate" the
output tokens (allocated as one chunk: the caching outcome is the same as
token by token), and free the oldest request once more than `concurrency`
are live. Token ids are random draws from a 32k vocabulary, so two prompts
share a prefix only where the workload says so.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from .kv_cache_manager import KVCacheManager
from .request import SimpleRequest

VOCAB = 32_000


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def chatbot(rng, n_requests=300, system_len=512, user=(20, 200), out=(20, 200)):
    """One fixed system prompt, then a fresh user message per request."""
    system = _toks(rng, system_len)
    for _ in range(n_requests):
        yield system + _toks(rng, rng.randint(*user)), rng.randint(*out)


def multi_turn(rng, n_conversations=40, turns=5, system_len=256, user=(50, 150), out=(50, 150)):
    """Conversations interleaved at random; each turn resends the whole history.

    The caller appends the generated tokens to the history (see `simulate`).
    """
    system = _toks(rng, system_len)
    convs = [{"history": list(system), "left": turns} for _ in range(n_conversations)]
    while convs:
        c = rng.choice(convs)
        c["history"] += _toks(rng, rng.randint(*user))
        c["left"] -= 1
        if c["left"] == 0:
            convs.remove(c)
        yield c, rng.randint(*out)


def rag(rng, n_requests=300, instruction_len=256, n_docs=400, doc_len=512, k=3, question=(20, 80)):
    """Shared instruction + k retrieved passages (Zipf-popular) + a question."""
    docs = [_toks(rng, doc_len) for _ in range(n_docs)]
    weights = [1 / (i + 1) ** 1.1 for i in range(n_docs)]
    instruction = _toks(rng, instruction_len)
    for _ in range(n_requests):
        picked = rng.choices(range(n_docs), weights, k=k)
        prompt = list(instruction)
        for d in picked:
            prompt += docs[d]
        yield prompt + _toks(rng, rng.randint(*question)), rng.randint(20, 200)


def random_prompts(rng, n_requests=300, length=(200, 800)):
    for _ in range(n_requests):
        yield _toks(rng, rng.randint(*length)), rng.randint(20, 200)


@dataclass
class HitRateResult:
    """What one `simulate` run measured: prefix-cache hits over the prompts it admitted."""
    requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float          # vLLM's metric: hit tokens / queried (prompt) tokens
    # hit_tokens is also the number of prefill tokens saved: they are not recomputed.


def simulate(m: KVCacheManager, stream: Iterator, concurrency: int = 8, seed: int = 0,
             free_order=None, after_request=None) -> HitRateResult:
    """Drive `stream` through `m`. Items are (prompt, n_out) or (conversation, n_out).

    `free_order(m, request)` replaces `m.free` (to compare freeing policies);
    `after_request(m)` is called after each request is admitted (to sample state).
    """
    rng = random.Random(seed)
    live: list[SimpleRequest] = []
    prompt_tokens = hit_tokens = 0
    stats0 = (m.prefix_cache_stats.queries, m.prefix_cache_stats.hits)
    free = free_order or (lambda mgr, r: mgr.free(r))
    for i, (item, n_out) in enumerate(stream):
        conv = item if isinstance(item, dict) else None
        prompt = list(conv["history"]) if conv else item
        req = SimpleRequest(f"r{i}", prompt)
        hit, n_hit = m.get_computed_blocks(req)
        while m.allocate_slots(req, req.num_tokens - n_hit, n_hit, hit) is None:
            if not live:
                raise ValueError("pool too small for a single request")
            free(m, live.pop(0))
        req.num_computed_tokens = req.num_tokens
        prompt_tokens += req.num_tokens
        hit_tokens += n_hit
        out = _toks(rng, n_out)
        req.all_token_ids += out
        while m.allocate_slots(req, n_out) is None:
            if not live:
                raise ValueError("pool too small for a single request")
            free(m, live.pop(0))
        req.num_computed_tokens = req.num_tokens
        if conv is not None:
            conv["history"] += out
        live.append(req)
        if len(live) > concurrency:
            free(m, live.pop(0))
        if after_request is not None:
            after_request(m)
    for r in live:
        free(m, r)
    q = m.prefix_cache_stats.queries - stats0[0]
    h = m.prefix_cache_stats.hits - stats0[1]
    assert h == hit_tokens and q == prompt_tokens, "stats disagree with the driver's own count"
    return HitRateResult(i + 1, prompt_tokens, hit_tokens, h / q if q else 0.0)
