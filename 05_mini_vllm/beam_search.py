"""Beam search as a client of the engine: each round, every live beam is a fresh one-token request.

vLLM counterparts: `vllm/beam_search.py` (BeamSearchParams,
BeamSearchSequence, BeamSearchOutput, get_beam_search_score) and
`LLM.beam_search` in `vllm/entrypoints/llm.py`, whose design this follows.

The search uses only `LLMEngine`'s public request API: `processor` (to
validate the prompts, all or nothing), `add_request`, `step`,
`abort_request` and `has_unfinished_requests`. It never touches the engine
core or the scheduler, which know nothing about beams. One round per
generated position, per prompt:
1. every live beam (prompt + its tokens so far) is added as a new request with
   `max_tokens=1` and `logprobs=2 * beam_width`; the step that completes it
   returns the top-2W log-probs of the next position (the token it sampled
   is ignored), and the request finishes by length at once;
2. once all live beams of the prompt reported, the candidates (beam, token)
   are ranked by score; EOS candidates (unless `ignore_eos`) go to the
   finished list; the best `beam_width` others are the next round's beams,
   added right away (other prompts' beams may still be running).

Beams share KV blocks through prefix caching (Chapter 2), not through
forks. A finished request's blocks go back to the pool with their hashes,
and the next round's requests, which extend those tokens, find every full
block among them: beams share their common prefix and each round computes
only each beam's last, partial block (1 to block_size tokens). vLLM v0 and
the thesis (seed 001 §3.4.4) forked beams copy-on-write inside the
scheduler; vLLM v1 dropped that for this re-submission, which keeps the
scheduler free of beam-only code and makes beam search one more client of
the engine. The costs: up to block_size recomputed tokens per beam and
round instead of one, and the beams' blocks are shared only while a round's
requests run together (between rounds they sit in the pool as cached,
evictable blocks; an evicted prefix is recomputed, with the same result).
Without prefix caching the search is still exact, but every round
recomputes every beam.

Invariants: a prompt has at most `beam_width` live beams, all of the same
length; each request the search adds ends within its round; when the search
returns (or raises), none of its requests is left in the engine, so every
KV block is back in the pool. Scores are log_softmax(logits / T) for
temperature T > 0 (vLLM v0's processed log-probs) and of the raw logits for
T = 0.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from mini_vllm.inputs import as_prompt_list
from mini_vllm.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass
class BeamSearchParams:
    """beam_width >= 1, max_tokens >= 1 (tokens per beam), temperature >= 0,
    length_penalty finite (score = cum_logprob / seq_len ** length_penalty)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite float, got {self.length_penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


@dataclass
class BeamSearchSequence:
    """A beam: `tokens` = prompt + output; `logprobs` = one per output token."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """cum_logprob / seq_len ** length_penalty; seq_len counts prompt and
    output, less a final EOS (vLLM's definition; HF counts only the output)."""
    seq_len = len(tokens) - (1 if eos_token_id is not None and tokens[-1] == eos_token_id else 0)
    return cumulative_logprob / (seq_len ** length_penalty)


class _PromptSearch:
    """One prompt's search: the beams to add next, this round's requests and
    their reports, and the finished beams."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, sp: SamplingParams) -> None:
        self.prompt, self.params, self.sp = prompt, params, sp
        self.live: list[BeamSearchSequence] = [BeamSearchSequence(list(prompt))]
        self.pending: dict[str, BeamSearchSequence] = {}  # request id -> its beam, this round
        self.reports: dict[str, list[tuple[int, float]]] = {}  # request id -> top-2W (token, logprob)
        self.done: list[BeamSearchSequence] = []


def run_beam_search(engine, prompts, params: BeamSearchParams, on_step=None) -> list[BeamSearchOutput]:
    """Search every prompt on `engine` (an idle `LLMEngine`) until all searches end.

    `params` is one BeamSearchParams or a list, one per prompt (benchmarks
    give each prompt its own max_tokens). `on_step(engine)`, if given, runs
    after every engine step (tests and benchmarks watch the KV pool with it).
    """
    prompts = as_prompt_list(prompts)
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts) or not all(isinstance(p, BeamSearchParams) for p in plist):
        raise ValueError(f"params must be a BeamSearchParams or a list of {len(prompts)} "
                         f"(one per prompt), got {params!r:.80}")
    w = max((p.beam_width for p in plist), default=1)
    max_seqs = engine.config.max_num_seqs
    if w > max_seqs:  # a round's beams run in one batch; fewer slots would split every round
        raise ValueError(f"beam_width must be <= max_num_seqs ({max_seqs}), got {w}")
    if engine.has_unfinished_requests():  # the search consumes every output of every step
        raise ValueError("beam_search needs an idle engine: finish or abort its requests first")
    vocab = engine.model_config.vocab_size
    if 2 * w > vocab:
        raise ValueError(f"beam_width must be <= vocab_size / 2 = {vocab // 2}, got {w}")
    # One token per request; the text of a beam is decoded once, at the end.
    sps = [SamplingParams(max_tokens=1, temperature=p.temperature, logprobs=2 * p.beam_width,
                          ignore_eos=True, detokenize=False) for p in plist]
    toks = [engine.processor.process_inputs("beam-check", p, sp).prompt_token_ids
            for p, sp in zip(prompts, sps)]  # all or nothing
    block_size, n_blocks = engine.config.block_size, engine.num_gpu_blocks
    for t, p in zip(toks, plist):  # a beam grows to prompt + max_tokens: it must fit the context and the pool
        if len(t) + p.max_tokens > engine.max_model_len:
            raise ValueError(f"max_tokens must be <= max_model_len - prompt length = "
                             f"{engine.max_model_len - len(t)}, got {p.max_tokens}")
        if -(-(len(t) + p.max_tokens) // block_size) > n_blocks:
            raise ValueError(f"the KV cache ({n_blocks} blocks of {block_size} tokens) is too small for "
                             f"a beam of {len(t) + p.max_tokens} tokens (prompt + max_tokens); give it "
                             f"more KV blocks or use a smaller max_tokens")
    eos = engine.eos_token_id
    searches = [_PromptSearch(t, p, sp) for t, p, sp in zip(toks, plist, sps)]
    owner: dict[str, _PromptSearch] = {}  # request id in the engine -> its prompt's search
    try:
        for s in searches:
            _add_round(engine, s, owner)
        while owner:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"the engine has no request left but {len(owner)} beams never reported")
            for out in engine.step():
                s = owner.get(out.request_id)
                if s is None or not out.finished:
                    continue
                del owner[out.request_id]
                s.reports[out.request_id] = _top_logprobs(out, 2 * s.params.beam_width)
                if len(s.reports) == len(s.pending):  # the prompt's round is complete
                    _select(s, eos)
                    _add_round(engine, s, owner)
            if on_step is not None:
                on_step(engine)
    finally:  # an exception must not leave beams holding blocks
        if owner:
            engine.abort_request(list(owner))
    return [_result(s, eos, engine.get_tokenizer()) for s in searches]


def _add_round(engine, s: _PromptSearch, owner: dict) -> None:
    """Add each live beam of `s` as a one-token request (its full blocks are prefix hits)."""
    for beam in s.live:
        rid = f"beam-{next(_ids)}"
        engine.add_request(rid, {"prompt_token_ids": beam.tokens}, s.sp, output_kind="final_only")
        s.pending[rid] = beam
        owner[rid] = s
    s.live = []


def _top_logprobs(out, k: int) -> list[tuple[int, float]]:
    """The top-k (token, logprob) of the one position the request sampled, best first.

    The output's logprobs dict holds the sampled token first, then the top k
    (vLLM's layout); a sampled token outside the top k (temperature > 0) is
    dropped, so every beam offers exactly k candidates. (vLLM's own
    `LLM.beam_search` keeps it as an extra candidate.)"""
    entries = list(out.outputs[0].logprobs[0].items())
    if len(entries) > k:
        entries = entries[1:]
    return sorted(((tok, lp.logprob) for tok, lp in entries), key=lambda e: e[1], reverse=True)


def _select(s: _PromptSearch, eos) -> None:
    """One round: rank every (beam, token) candidate; keep the best beam_width."""
    params = s.params
    cands = []
    for rid, beam in s.pending.items():
        for tok, lp in s.reports[rid]:
            new = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [lp], beam.cum_logprob + lp)
            if tok == eos and not params.ignore_eos:
                new.finish_reason = "stop"
                s.done.append(new)
            else:
                cands.append(new)
    key = lambda b: get_beam_search_score(b.tokens, b.cum_logprob, eos, params.length_penalty)
    chosen = sorted(cands, key=key, reverse=True)[:params.beam_width]
    s.pending, s.reports = {}, {}
    if chosen and len(chosen[0].tokens) - len(s.prompt) >= params.max_tokens:  # the last round
        for b in chosen:
            b.finish_reason = "length"
        s.done.extend(chosen)
    else:
        s.live = chosen


def _result(s: _PromptSearch, eos, tokenizer) -> BeamSearchOutput:
    params = s.params
    ranked = sorted(s.done, key=lambda b: get_beam_search_score(b.tokens, b.cum_logprob, eos,
                                                                params.length_penalty), reverse=True)
    best = ranked[:params.beam_width]
    if tokenizer is not None:
        for b in best:
            b.text = tokenizer.decode(b.tokens)
    return BeamSearchOutput(best)
