"""From a step's hidden states to its output: sampling, verification, prompt logprobs.

vLLM counterparts: `GPUModelRunner._sample`, `_get_prompt_logprobs_dict` and the end
of `execute_model` in `vllm/v1/worker/gpu_model_runner.py`; the sampling state pooled
in the persistent batch (`vllm/v1/worker/gpu_input_batch.py`: `refresh_metadata`); the
grammar bitmask of `vllm/v1/structured_output/`.

Two declared parts plug into `ModelRunner.execute_model`:
* `StepSampler`: the sampling state kept across steps (the persistent batch's sampling
  columns, one grammar per constrained request, the verifier's counters) and the one
  place where logits become tokens, for plain rows and for draft rows alike.
* an output mode, `OutputMode`'s interface: `StepOutputs` here, whose tokens reach the
  host within the step (synchronous scheduling; asynchronous with speculation, where
  the runner appends its own tokens), or `async_output.DeferredOutputs` (asynchronous
  without speculation: the step returns before its tokens reach the host).
"""
from __future__ import annotations

import numpy as np
import torch

from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sample.sampler import Sampler, gather_logprobs
from mini_vllm.scheduler import ModelRunnerOutput
from mini_vllm.spec_decode.engine.verifier import SpecVerifier
from mini_vllm.structured_output import StructuredOutputs
from mini_vllm.worker.drafter import Drafter
from mini_vllm.worker.input_batch import CachedRequestState, InputBatch, StepInputs


class StepSampler:
    """Logits rows -> tokens (and logprobs), from the request states' sampling columns."""

    def __init__(self, sampler: Sampler, verifier: SpecVerifier, structured: StructuredOutputs,
                 requests: dict[str, CachedRequestState], input_batch: InputBatch) -> None:
        self.sampler, self.verifier, self.structured = sampler, verifier, structured
        self.requests, self.input_batch = requests, input_batch

    def metadata(self, states, device, token_bitmask=None) -> SamplingMetadata:
        """One row per request state: the same metadata for plain sampling and for
        verifying drafts, so both apply one temperature / top-k / top-p. Gathered
        from the persistent batch's sampling columns, and only when these rows
        changed (vLLM's `refresh_metadata`); `SamplingMetadata.from_params` over
        the same states is the from-scratch equivalent."""
        return self.input_batch.refresh_metadata([s.req_id for s in states], [s.output_token_ids for s in states],
                                                 device, token_bitmask)

    def sample_on_device(self, logits: torch.Tensor, rids: list[str]):
        """(the requests' states, the SamplerOutput): one token per row, still on the device."""
        states = [self.requests[r] for r in rids]
        return states, self.sampler(logits, self.metadata(states, logits.device, self.structured.bitmask(states)))

    def sample(self, logits: torch.Tensor, rids: list[str], sampled: dict, logprobs: dict) -> None:
        """sampled[rid] = [token] per row, and logprobs[rid] for the requests that asked."""
        states, out = self.sample_on_device(logits, rids)
        toks = out.sampled_token_ids.tolist()
        lp = out.logprobs_tensors
        if lp is not None:
            ids_l, lps_l, ranks_l = (lp.logprob_token_ids.tolist(), lp.logprobs.tolist(),
                                     lp.selected_token_ranks.tolist())
        for j, (rid, st) in enumerate(zip(rids, states)):
            sampled[rid] = [int(toks[j])]
            n_lp = st.sampling_params.logprobs
            if lp is not None and n_lp is not None:
                logprobs[rid] = [(ids_l[j][:n_lp + 1], lps_l[j][:n_lp + 1], ranks_l[j])]

    def sample_step(self, logits: torch.Tensor, step: StepInputs,
                    drafts: dict[str, list[int]]) -> tuple[dict[str, list[int]], dict[str, list]]:
        """(tokens per scheduled request, logprobs): `logits` holds the rows of
        `step.logit_rows`; a request verifying k drafts owns k + 1 consecutive rows."""
        req_ids = step.req_ids
        sampled: dict[str, list[int]] = {r: [] for r in req_ids}
        logprobs: dict[str, list] = {}
        plain, plain_rows, spec, spec_rows, row = [], [], [], [], 0
        for i in step.sample_req:
            k = len(drafts.get(req_ids[i], ()))
            (spec if k else plain).append(i)
            (spec_rows.extend(range(row, row + k + 1)) if k else plain_rows.append(row))
            row += k + 1
        if plain:
            self.sample(logits[plain_rows] if spec else logits, [req_ids[i] for i in plain], sampled, logprobs)
        if spec:
            rids = [req_ids[i] for i in spec]
            emitted = self.verifier.verify(logits[spec_rows], [drafts[r] for r in rids],
                                           self.metadata([self.requests[r] for r in rids], logits.device))
            sampled.update(zip(rids, emitted))
        return sampled, logprobs

    def forget(self, req_id: str) -> None:
        self.structured.forget(req_id)


class OutputMode:
    """How a step's output leaves the runner. The interface `ModelRunner` calls:
    `before_step(so)` before the batch changes, `feed_back(...)` while inputs are
    prepared, `finish(step, hidden)` after the forward pass, `empty()` for a step
    with nothing scheduled."""

    def before_step(self, so) -> None:
        pass

    def pending_rows(self, req_ids, num_tokens, computed, num_sched, query_start_loc) -> tuple[list[int], list[int]]:
        """(input rows, entries of the pending step's tokens) for tokens the host does not know yet."""
        return [], []

    def feed_back(self, input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        pass

    def finish(self, step: StepInputs, hidden: torch.Tensor):
        raise NotImplementedError

    def empty(self) -> ModelRunnerOutput:
        return ModelRunnerOutput([], {}, [])


class StepOutputs(OutputMode):
    """A step whose tokens reach the host before it returns. Under asynchronous
    scheduling (with speculation, the only asynchronous case that comes here) the
    next SchedulerOutput is built before the scheduler knows this step's tokens, so
    the runner appends them to its request states itself (`append_own_tokens`)."""

    def __init__(self, model, sampler: StepSampler, drafter: Drafter, append_own_tokens: bool) -> None:
        self.model, self.sampler, self.drafter = model, sampler, drafter
        self.append_own_tokens = append_own_tokens

    def finish(self, step: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        sampled: dict[str, list[int]] = {r: [] for r in step.req_ids}
        logprobs: dict[str, list] = {}
        if step.sample_req:
            logits = self.model.compute_logits(hidden.index_select(0, step.logit_rows))
            sampled, logprobs = self.sampler.sample_step(logits, step, self.drafter.step_drafts)
        if self.append_own_tokens:
            self.sampler.input_batch.append_sampled(self.sampler.requests, sampled)
        self.drafter.after_sampling(step, sampled)
        mro = ModelRunnerOutput.from_dict(sampled)
        mro.logprobs = logprobs or None
        mro.prompt_logprobs_dict = prompt_logprobs_dict(self.model, self.sampler.requests, hidden, step) or None
        mro.spec_token_ids = self.drafter.propose(step, hidden, sampled)
        return mro


def prompt_logprobs_dict(model, requests: dict[str, CachedRequestState], hidden: torch.Tensor,
                         step: StepInputs) -> dict:
    """Log-softmax of the raw logits at every prompt row of this step, for
    requests with prompt_logprobs (vLLM's `_get_prompt_logprobs_dict`: filled
    chunk by chunk as the prompt is computed, sent once, on the step that
    completes the prompt). Row p predicts prompt token p + 1, so a prompt of P
    tokens has P - 1 entries; the chunk starting at position s with q tokens
    fills entries s .. min(s + q, P - 1) - 1. Raw logits, as vLLM's default
    logprobs mode: no temperature or penalty applies to a prompt. A request
    preempted mid-prompt recomputes and rewrites the same entries."""
    md = step.attn_metadata
    out, start_row = {}, 0
    for i, rid in enumerate(step.req_ids):
        q = md.query_lens_cpu[i]
        row0, start_row = start_row, start_row + q
        st = requests[rid]
        k = st.sampling_params.prompt_logprobs
        if k is None or st.prompt_logprobs_sent:
            continue
        n_prompt = len(st.prompt_token_ids)
        start = md.seq_lens_cpu[i] - q  # tokens computed before this step
        if st.prompt_logprobs_in_progress is None:
            st.prompt_logprobs_in_progress = (np.zeros((n_prompt - 1, k + 1), np.int64),
                                              np.zeros((n_prompt - 1, k + 1), np.float32),
                                              np.zeros(n_prompt - 1, np.int64))
        n = min(q, n_prompt - 1 - start)
        if n > 0:
            logits = model.compute_logits(hidden[row0:row0 + n])
            targets = torch.tensor(st.prompt_token_ids[start + 1:start + 1 + n], device=logits.device)
            lp = gather_logprobs(logits.float().log_softmax(dim=-1), k, targets)
            ids, vals, ranks = st.prompt_logprobs_in_progress
            ids[start:start + n] = lp.logprob_token_ids.cpu().numpy()
            vals[start:start + n] = lp.logprobs.cpu().numpy()
            ranks[start:start + n] = lp.selected_token_ranks.cpu().numpy()
        if start + q >= n_prompt:  # the prompt is complete: this step samples its first token
            out[rid] = tuple(a.tolist() for a in st.prompt_logprobs_in_progress)
            st.prompt_logprobs_in_progress, st.prompt_logprobs_sent = None, True
    return out
