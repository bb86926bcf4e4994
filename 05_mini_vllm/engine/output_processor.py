"""Turn the engine core's per-step token lists into `RequestOutput`s.

vLLM counterpart: `vllm/v1/engine/output_processor.py` (`OutputProcessor`,
`RequestState`); `parallel_sampling.py` fans a request with n samples out
into n core requests, and this module joins their outputs back.

Per request it keeps the detokenizer, the tokens, logprobs, timing, and for
n > 1 one `_Sample` per sibling. Output kinds (vLLM's `RequestOutputKind`):
"cumulative" (everything so far, every step), "delta" (only what is new),
"final_only" (one output when the request finishes; `LLM.generate` uses it).
Invariant: a request's `finished` output is produced exactly once, and its
state is dropped right after.

Where a request finishes: stop tokens, max_tokens and length are decided in
the scheduler (`update_from_output`), which reports them as a finish reason
here; stop strings in the detokenizer, which `process_outputs` reports (the
core ids it returns) to LLMEngine.step, which finishes them in the engine core
before the next schedule. This module never calls the engine core itself
(vLLM: `OutputProcessorOutput.reqs_to_abort`).
"""
from __future__ import annotations

import time

from mini_vllm.engine.detokenizer import IncrementalDetokenizer
from mini_vllm.metrics.stats import FinishedRequestStats, IterationStats
from mini_vllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.engine.parallel_sampling import child_request_id

OUTPUT_KINDS = ("cumulative", "delta", "final_only")


class _Sample:
    def __init__(self, index: int, detok: IncrementalDetokenizer, want_logprobs: bool) -> None:
        self.index = index
        self.detok = detok
        self.token_ids: list[int] = []
        self.logprobs = [] if want_logprobs else None
        self.cumulative_logprob = 0.0 if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.sent_tokens = 0
        self.last_token_time: float | None = None
        self.final_sent = False


class RequestState:
    def __init__(self, request_id, prompt, prompt_token_ids, params: SamplingParams, tokenizer,
                 output_kind, arrival_time) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params, self.output_kind, self.tokenizer = params, output_kind, tokenizer
        lp = params.logprobs is not None
        self.samples = [_Sample(i, IncrementalDetokenizer(tokenizer, prompt_token_ids, params), lp)
                        for i in range(params.n)]
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.prompt_logprobs = None  # PromptLogprobs once the prompt is computed
        self.prompt_logprobs_sent = False  # "delta" outputs carry them once

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self._by_core_id: dict[str, tuple[RequestState, int]] = {}

    def add_request(self, request_id, prompt, prompt_token_ids, params, output_kind,
                    arrival_time) -> list[str]:
        """Register a request; returns the core request ids of its n samples."""
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        st = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer,
                          output_kind, arrival_time)
        self.request_states[request_id] = st
        ids = [request_id] + [child_request_id(request_id, i) for i in range(1, len(st.samples))]
        for i, cid in enumerate(ids):
            self._by_core_id[cid] = (st, i)
        return ids

    def core_ids(self, request_id: str) -> list[str]:
        st = self.request_states.get(request_id)
        if st is None:
            return []
        return [request_id] + [child_request_id(request_id, i) for i in range(1, len(st.samples))]

    def abort_requests(self, request_ids) -> None:
        for rid in request_ids:
            for cid in self.core_ids(rid):
                self._by_core_id.pop(cid, None)
            self.request_states.pop(rid, None)

    def mark_scheduled(self, core_ids, now: float) -> None:
        for cid in core_ids:
            hit = self._by_core_id.get(cid)
            if hit is not None and hit[0].metrics.first_scheduled_time is None:
                hit[0].metrics.first_scheduled_time = now

    def process_outputs(self, core_outputs, now: float | None = None):
        """Returns (request outputs, core ids stopped by a stop string, IterationStats).

        The stopped ids are still running in the engine core: the caller
        (`LLMEngine.step`) must finish them there before the next schedule."""
        now = time.monotonic() if now is None else now
        it = IterationStats()
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []  # vLLM's reqs_to_abort
        for o in core_outputs:
            hit = self._by_core_id.get(o.request_id)
            if hit is None:
                continue  # aborted meanwhile
            st, idx = hit
            smp = st.samples[idx]
            if smp.finish_reason is not None:
                continue
            self._timing(st, smp, len(o.new_token_ids), now, it)
            smp.token_ids.extend(o.new_token_ids)
            st.num_cached_tokens = max(st.num_cached_tokens, o.num_cached_tokens)
            self._logprobs(smp, o)
            if o.prompt_logprobs is not None and st.prompt_logprobs is None:
                st.prompt_logprobs = self._prompt_logprobs(o.prompt_logprobs)
            reason = o.finish_reason
            stop_tok = reason == "stop" and bool(o.new_token_ids)
            if stop_tok and o.new_token_ids[-1] in st.params.stop_token_ids:
                smp.stop_reason = o.new_token_ids[-1]
            hit_str = smp.detok.update(o.new_token_ids, stop_terminated=stop_tok)
            if hit_str is not None:  # a stop string wins over the length cap
                if reason is None:
                    stopped.append(o.request_id)  # the core must free its blocks
                reason, smp.stop_reason = "stop", hit_str
            smp.finish_reason = reason
            touched[st.request_id] = st
        outs = []
        for st in touched.values():
            if st.finished:
                st.metrics.finished_time = now
                it.finished_requests.append(self._finished_stats(st))
                self.abort_requests([st.request_id])
            ro = self._make_output(st)
            if ro is not None:
                outs.append(ro)
        return outs, stopped, it

    def _timing(self, st, smp, n_new, now, it) -> None:
        if n_new == 0:
            return
        it.num_generation_tokens += n_new
        m = st.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            it.time_to_first_tokens.append(now - m.arrival_time)
        if smp.last_token_time is not None:
            it.inter_token_latencies.append(now - smp.last_token_time)
            m.inter_token_latencies.append(now - smp.last_token_time)
        smp.last_token_time = m.last_token_time = now

    def _logprobs(self, smp, o) -> None:
        if smp.logprobs is None:
            return
        for tok, entry in zip(o.new_token_ids, o.logprobs or []):
            ids, lps, rank = entry
            d = {int(ids[0]): Logprob(float(lps[0]), int(rank), self._text(ids[0]))}
            for r, (t, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                d.setdefault(int(t), Logprob(float(lp), r, self._text(t)))
            smp.logprobs.append(d)
            smp.cumulative_logprob += float(lps[0])

    def _prompt_logprobs(self, entries) -> list:
        """(ids, logprobs, ranks) per prompt position after the first -> PromptLogprobs."""
        out: list = [None]
        for ids, lps, rank in zip(*entries):
            d = {int(ids[0]): Logprob(float(lps[0]), int(rank), self._text(ids[0]))}
            for r, (t, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                d.setdefault(int(t), Logprob(float(lp), r, self._text(t)))
            out.append(d)
        return out

    def _text(self, tok) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([int(tok)])

    def _finished_stats(self, st) -> FinishedRequestStats:
        m = st.metrics
        first = m.first_scheduled_time if m.first_scheduled_time is not None else m.arrival_time
        first_tok = m.first_token_time if m.first_token_time is not None else first
        last_tok = m.last_token_time if m.last_token_time is not None else first_tok
        return FinishedRequestStats(st.request_id, st.samples[0].finish_reason,
                                    m.finished_time - m.arrival_time, first - m.arrival_time,
                                    m.ttft, len(st.prompt_token_ids),
                                    sum(len(s.token_ids) for s in st.samples),
                                    n=len(st.samples), max_tokens=st.params.max_tokens,
                                    max_num_generation_tokens=max(len(s.token_ids) for s in st.samples),
                                    prefill_time=first_tok - first, decode_time=last_tok - first_tok,
                                    inference_time=last_tok - first)

    def _make_output(self, st: RequestState) -> RequestOutput | None:
        finished = st.finished
        if st.output_kind == "final_only" and not finished:
            return None
        delta = st.output_kind == "delta"
        comps = []
        for s in st.samples:
            done = s.finish_reason is not None
            toks = s.token_ids[s.sent_tokens:] if delta else list(s.token_ids)
            if delta and not toks and (not done or s.final_sent):
                continue
            s.final_sent = done
            lps = None if s.logprobs is None else (s.logprobs[s.sent_tokens:] if delta else list(s.logprobs))
            comps.append(CompletionOutput(s.index, s.detok.get_next_output_text(done, delta), toks,
                                          s.cumulative_logprob, lps, s.finish_reason, s.stop_reason))
            s.sent_tokens = len(s.token_ids)
        plp = st.prompt_logprobs
        if delta and plp is not None:
            plp, st.prompt_logprobs_sent = (None if st.prompt_logprobs_sent else plp), True
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, comps, finished,
                             st.metrics, st.num_cached_tokens, plp)
