"""Beam search on the engine, with beams that fork and free KV blocks.

vLLM counterparts: `vllm/beam_search.py` (BeamSearchParams,
BeamSearchSequence, BeamSearchOutput, get_beam_search_score) and
`LLM.beam_search` in `vllm/entrypoints/llm.py`. vLLM v1 re-submits every
beam as a fresh one-token request each step and lets prefix caching find the
shared prefix. Here beams share blocks the way the thesis describes (seed 001
§3.4.4): each live beam is one scheduler request; a beam that survives with
several continuations FORKS (Chapter 2's copy-on-write `fork`), and a beam
that is cut is aborted, so its private blocks return to the pool at once.

One round per generated position, per prompt:
1. every live beam is scheduled and samples once; its request carries
   `logprobs = 2 * beam_width`, so the step returns its top-2W log-probs;
2. the driver takes the sampled token back (`Scheduler.pop_last_token`): the
   beam is parked, all its tokens computed, and is not scheduled again;
3. once all live beams of the prompt reported, the candidates (beam, token)
   are ranked by score; EOS candidates (unless `ignore_eos`) go to the
   finished list; the best `beam_width` others live on: a beam keeps its best
   chosen token (`append_token`), forks one request per further chosen token
   (`fork_request`) and is aborted when none was chosen.

Invariants: a prompt has at most `beam_width` live beams; every live beam's
tokens all have the same length; when the search returns, every request it
made is finished and its blocks are back in the pool. Scores are
log_softmax(logits / T) for temperature T > 0 (vLLM v0's processed
log-probs) and of the raw logits for T = 0.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler import Request

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
    """The live beams, this round's reports and the finished beams of one prompt."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, sp: SamplingParams) -> None:
        self.params, self.sp = params, sp
        self.live: dict[str, BeamSearchSequence] = {}
        self.reports: dict[str, tuple[list[int], list[float]]] = {}
        self.done: list[BeamSearchSequence] = []
        self.prompt = prompt
        self.preemptions_at_round = 0


def run_beam_search(engine, prompts, params: BeamSearchParams, on_step=None) -> list[BeamSearchOutput]:
    """Drive `engine.engine_core` until every prompt's search ends.

    `params` is one BeamSearchParams or a list, one per prompt (benchmarks
    give each prompt its own max_tokens). `on_step(core)`, if given, runs
    after every engine step and every selection round (tests and benchmarks
    watch the KV pool with it).
    """
    from mini_vllm.entrypoints.llm import LLM  # its prompt normalisation; llm.py imports this module lazily

    prompts = LLM._as_list(prompts)
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts) or not all(isinstance(p, BeamSearchParams) for p in plist):
        raise ValueError(f"params must be a BeamSearchParams or a list of {len(prompts)} "
                         f"(one per prompt), got {params!r:.80}")
    core, w = engine.engine_core, max((p.beam_width for p in plist), default=1)
    max_seqs = engine.config.max_num_seqs
    if w > max_seqs:
        raise ValueError(f"beam_width must be <= max_num_seqs ({max_seqs}), got {w}")
    if engine.has_unfinished_requests():
        raise ValueError("beam_search needs an idle engine: finish or abort its requests first")
    vocab = engine.model_config.vocab_size
    if 2 * w > vocab:
        raise ValueError(f"beam_width must be <= vocab_size / 2 = {vocab // 2}, got {w}")
    sps = [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, logprobs=2 * p.beam_width,
                          ignore_eos=True) for p in plist]
    toks = [engine.process_inputs(p, sp)[1] for p, sp in zip(prompts, sps)]  # all or nothing
    for t, p in zip(toks, plist):  # every beam runs max_tokens steps: they must fit the context
        if len(t) + p.max_tokens > engine.max_model_len:
            raise ValueError(f"max_tokens must be <= max_model_len - prompt length = "
                             f"{engine.max_model_len - len(t)}, got {p.max_tokens}")
    eos = engine.eos_token_id
    sched = core.scheduler
    searches: dict[str, _PromptSearch] = {}  # request id -> its prompt's search
    all_searches = [_PromptSearch(t, p, sp) for t, p, sp in zip(toks, plist, sps)]
    # Prompts at a time: all their beams fit in max_num_seqs, so forks need not wait.
    todo, active = list(all_searches), []
    limit = max(1, max_seqs // w)
    try:
        while todo or active:
            while todo and len(active) < limit:
                s = todo.pop(0)
                rid = f"beam-{next(_ids)}"
                core.add_request(Request(rid, s.prompt, s.sp, eos_token_id=eos))
                s.live[rid] = BeamSearchSequence(list(s.prompt))
                searches[rid] = s
                active.append(s)
                s.preemptions_at_round = sched.num_preemptions
            before = _progress(sched)
            for out in core.step().outputs:
                s = searches.get(out.request_id)
                if s is None or not out.new_token_ids:
                    continue
                if not out.finished:
                    sched.pop_last_token(out.request_id)  # park the beam
                if out.request_id in s.reports:
                    continue  # recomputed after a preemption: same logits, already known
                ids, lps, _rank = out.logprobs[0]
                s.reports[out.request_id] = (ids[1:], lps[1:])  # [0] is the sampled token
            rounds = 0
            for s in active:
                if len(s.reports) == len(s.live):
                    _select(s, s.params, eos, core, searches)
                    s.preemptions_at_round = sched.num_preemptions
                    rounds += 1
                elif sched.num_preemptions - s.preemptions_at_round > 4 * w * limit:
                    _too_small(core, w, "beams keep preempting each other")
            if not rounds and _progress(sched) == before:
                # Stuck: parked beams hold blocks and are never scheduled, so nothing
                # preempts them for a waiting beam. Restart the newest prompt later,
                # with one prompt fewer at a time; a single prompt that does not fit fails.
                if len(active) == 1:
                    _too_small(core, w, "a waiting beam cannot get blocks while the parked ones hold them")
                victim = active.pop()
                core.abort_requests([r for r in victim.live if r in sched.requests])
                for r in victim.live:
                    searches.pop(r, None)
                victim.__init__(victim.prompt, victim.params, victim.sp)
                todo.insert(0, victim)
                limit = len(active)
            active = [s for s in active if s.live]
            if on_step is not None:
                on_step(core)
    finally:  # an exception must not leave beams holding blocks
        left = [r for r in searches if r in sched.requests]
        if left:
            core.abort_requests(left)
    return [_result(s, s.params, eos, engine.get_tokenizer()) for s in all_searches]


def _progress(sched) -> tuple[int, int]:
    return sum(r.num_computed_tokens for r in sched.requests.values()), sched.num_preemptions


def _too_small(core, w: int, why: str):
    raise ValueError(f"the KV cache ({core.num_gpu_blocks} blocks) is too small for beam_width={w}: "
                     f"{why}; give it more KV blocks or use a smaller beam_width")


def _select(s: _PromptSearch, params: BeamSearchParams, eos, core, searches) -> None:
    """One round: rank every (beam, token) candidate, fork, keep and cut beams."""
    cands = []
    for rid, beam in s.live.items():
        ids, lps = s.reports[rid]
        for tok, lp in zip(ids, lps):
            new = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [lp], beam.cum_logprob + lp)
            if tok == eos and not params.ignore_eos:
                new.finish_reason = "stop"
                s.done.append(new)
            else:
                cands.append((rid, tok, new))
    key = lambda c: get_beam_search_score(c[2].tokens, c[2].cum_logprob, eos, params.length_penalty)
    chosen = sorted(cands, key=key, reverse=True)[:params.beam_width]
    last_round = len(s.live[next(iter(s.live))].tokens) - len(s.prompt) + 1 >= params.max_tokens
    old, s.live, s.reports = s.live, {}, {}
    sched = core.scheduler
    if last_round:  # the scheduler finished the beams by length already
        for _rid, _tok, new in chosen:
            new.finish_reason = "length"
            s.done.append(new)
        gone = [r for r in old if r in sched.requests]
    else:
        kept: set[str] = set()
        gone = [r for r in old if all(c[0] != r for c in chosen)]
        core.abort_requests(gone)  # cut beams: their private blocks are free now
        keep = []
        for rid, tok, new in chosen:  # forks first: a parent must still be parked
            if rid not in kept:
                kept.add(rid)
                keep.append((rid, tok, new))
            else:
                child = f"beam-{next(_ids)}"
                sched.fork_request(rid, child, tok)
                s.live[child] = new
                searches[child] = s
        for rid, tok, new in keep:
            sched.append_token(rid, tok)
            s.live[rid] = new
        gone = []
    if gone:
        core.abort_requests(gone)
    for r in old:
        if r not in s.live:
            searches.pop(r, None)


def _result(s: _PromptSearch, params: BeamSearchParams, eos, tokenizer) -> BeamSearchOutput:
    ranked = sorted(s.done, key=lambda b: get_beam_search_score(b.tokens, b.cum_logprob, eos,
                                                                params.length_penalty), reverse=True)
    best = ranked[:params.beam_width]
    if tokenizer is not None:
        for b in best:
            b.text = tokenizer.decode(b.tokens)
    return BeamSearchOutput(best)
