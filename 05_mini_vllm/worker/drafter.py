"""Speculative decoding's part of a runner step, behind one declared interface.

vLLM counterpart: the `drafter` of `GPUModelRunner` in `vllm/v1/worker/gpu_model_runner.py`
(`propose_draft_token_ids` with its n-gram, draft-model and EAGLE branches, and the
draft ids it keeps between steps under asynchronous scheduling).

`ModelRunner.execute_model` calls the same hooks whatever speculation runs, and never
asks which one: `Drafter` itself is "no speculation" (every hook does nothing), and
`TokenDrafter` (Chapter 4's n-gram lookup or a draft model) and `EagleDrafter` (a head
on the target's hidden states, `spec_decode/engine/eagle.py`) override what they need. Each hook
takes typed inputs (`StepInputs`, the hidden states, the sampled tokens) and reads the
runner's request states and persistent batch, which it is given once, at construction.

Hooks, in the order a step calls them:
* `forget(req_id)`: the request finished or was preempted (a draft model frees its KV,
  asynchronous drafts are dropped);
* `blocks_moved(so)`: the step's swaps and copies, for state kept per KV block (EAGLE);
* `fill(req_id, scheduled, last_token)`: the drafts to feed in place of the scheduled ones
  (asynchronous scheduling sends placeholders, which the runner's own drafts replace);
* `after_sampling(step, sampled)`: asynchronous speculation keeps the runner's own count of
  computed tokens (`async_drafts.py`); `keeps_computed_counts` says the runner must not take
  the scheduler's;
* `propose(step, hidden, sampled)`: the drafts for the scheduler's next `schedule()`, or None.

The drafts this step verifies (`step_drafts`) are the ones `fill` returned; every scheduled
draft is verified.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from mini_vllm.spec_decode import NgramProposer
from mini_vllm.spec_decode.engine.verifier import spec_eligible
from mini_vllm.worker.async_drafts import AsyncDrafts
from mini_vllm.worker.input_batch import CachedRequestState, InputBatch, StepInputs


class Drafter:
    """No speculative decoding: no drafts are scheduled, none are proposed."""

    def __init__(self, requests: dict[str, CachedRequestState], input_batch: InputBatch,
                 max_model_len: int, proposer=None, async_scheduling: bool = False,
                 spec_tokens_for_batch: Callable[[int], int] | None = None) -> None:
        self.requests, self.input_batch, self.max_model_len = requests, input_batch, max_model_len
        # Chapter 4's `NgramProposer`, `spec_decode.engine.proposers.DraftModelProposer` or an
        # `spec_decode.engine.eagle_base.EagleProposerBase`; None here.
        self.proposer = proposer
        # Dynamic speculative decoding (`SpeculativeConfig.num_tokens_for_batch`, or the
        # measured `spec_decode.engine.auto_schedule.AutoSchedule` the worker sets after capture): how
        # many drafts to propose after a step of n requests; None: always the proposer's k.
        self.spec_tokens_for_batch = spec_tokens_for_batch
        # Asynchronous scheduling with speculation: the drafts kept between steps and the
        # runner's own computed counts (`async_drafts.py`); None otherwise.
        self.async_drafts = AsyncDrafts() if async_scheduling and proposer is not None else None
        # Under asynchronous scheduling the runner appended this step's tokens already.
        self.async_scheduling = async_scheduling
        self.step_drafts: dict[str, list[int]] = {}

    @property
    def keeps_computed_counts(self) -> bool:
        """The runner keeps its own computed counts instead of taking the scheduler's."""
        return self.async_drafts is not None

    def forget(self, req_id: str) -> None:
        if self.async_drafts is not None:
            self.async_drafts.drop(req_id)

    def blocks_moved(self, so) -> None:
        pass

    def begin_step(self) -> None:
        self.step_drafts = {}

    def fill(self, req_id: str, scheduled: list[int], last_token: int) -> list[int]:
        drafts = scheduled
        if self.async_drafts is not None and AsyncDrafts.are_placeholders(scheduled):
            drafts = self.async_drafts.fill(req_id, scheduled, last_token)
        self.step_drafts[req_id] = list(drafts)
        return drafts

    def after_sampling(self, step: StepInputs, sampled: dict[str, list[int]]) -> None:
        """Asynchronous speculation: this runner's count of computed tokens moves by what
        the step computed and kept (scheduled tokens minus rejected drafts), see
        async_drafts.py; the scheduler learns of the rejections a step later."""
        if self.async_drafts is None:
            return
        batch = self.input_batch
        for rid, n in zip(step.req_ids, step.attn_metadata.query_lens_cpu):
            drafts, toks = self.step_drafts.get(rid, ()), sampled.get(rid)
            rejected = len(drafts) - (len(toks) - 1) if drafts and toks else 0
            st = self.requests[rid]
            st.num_computed_tokens += n - rejected
            row = batch.req_id_to_index.get(rid)
            if row is not None:
                batch.num_computed_tokens[row] = st.num_computed_tokens

    def propose(self, step: StepInputs, hidden: torch.Tensor,
                sampled: dict[str, list[int]]) -> dict[str, list[int]] | None:
        return None

    def num_drafts_after(self, batch_size: int) -> int:
        """Drafts per request to propose after a step that scheduled `batch_size`
        requests (vLLM's scheduler computes the same count as num_spec_tokens_to_schedule)."""
        k = self.proposer.k
        return k if self.spec_tokens_for_batch is None else min(k, self.spec_tokens_for_batch(batch_size))

    def _publish(self, sampled: dict[str, list[int]], drafts: dict[str, list[int]]) -> dict[str, list[int]] | None:
        """The drafts for the scheduler's next schedule(); under asynchronous scheduling the
        next step is scheduled already, with placeholders this runner fills."""
        if self.async_drafts is None:
            return drafts
        self.async_drafts.store([r for r, t in sampled.items() if t], drafts)
        return None


class TokenDrafter(Drafter):
    """Drafts from the tokens known after a step: Chapter 4's `NgramProposer` takes the
    contexts in order, a `DraftModelProposer` by request id (its KV is per request).
    With k = 0 nothing is proposed; the draft model feeds the tokens it missed at its
    next call, so its KV needs no pass of its own meanwhile."""

    def forget(self, req_id: str) -> None:
        super().forget(req_id)
        if not isinstance(self.proposer, NgramProposer):  # the draft model's KV; the n-gram lookup keeps nothing
            self.proposer.free(req_id)

    def propose(self, step, hidden, sampled):
        k = self.num_drafts_after(len(step.req_ids))
        drafts: dict[str, list[int]] = {}
        # The contexts are copied only when something is proposed (k = 0 under a batch-size schedule).
        reqs = {} if k == 0 else {
            rid: self.requests[rid].token_ids + ([] if self.async_scheduling else toks)
            for rid, toks in sampled.items() if toks and spec_eligible(self.requests[rid].sampling_params)}
        if reqs:
            if isinstance(self.proposer, NgramProposer):
                got = dict(zip(reqs, self.proposer.propose(list(reqs.values()))))
            else:
                got = self.proposer.propose(reqs)
            drafts = {r: d[:k] for r, d in got.items() if d}
        return self._publish(sampled, drafts)
