"""Speculative decoding under asynchronous scheduling: the runner's half.

vLLM counterpart: the async-scheduling branch of speculative decoding in
`vllm/v1/worker/gpu_model_runner.py` (the draft ids the runner keeps from its
last step, written over the scheduler's placeholder drafts when it prepares the
next step's inputs, and the positions corrected by the tokens that step
rejected).

The scheduler decides step N + 1 before step N's tokens are back. A request that
samples in step N therefore gets, in step N + 1, k placeholder drafts
(`PLACEHOLDER_TOKEN_ID`) and the positions of the optimistic case, every draft
of step N accepted. The runner knows better: steps run in order on one thread,
so when it prepares step N + 1, step N has been verified and its drafts for
N + 1 proposed. Two things follow, both kept here:

- `drafts[req_id]`: the drafts the proposer made after the request's last step;
  they replace the placeholders. Fewer than scheduled (near the draft model's
  context limit) are padded with the last one: any token is a valid draft (a
  deterministic proposal, verified like the others), only less likely accepted.
- the runner's own `num_computed_tokens` per request: advanced by the tokens a
  step scheduled minus the drafts it rejected. The scheduler's count is ahead
  by the rejections of the step still in flight when it scheduled; positions,
  slots and sequence lengths come from the runner's count. The scheduler's
  blocks cover its larger count, so every slot written is allocated.

A request the verifier cannot serve (`spec_eligible` false: seeded, logprobs,
penalties, grammars...) gets no placeholder drafts: the engine core tells the
scheduler so (`Request.spec_decode`). Invariant, per request: scheduler count -
runner count = the rejections of the steps the scheduler had not heard of,
between 0 and k per step in flight.
"""
from __future__ import annotations

from mini_vllm.spec_decode import PLACEHOLDER_TOKEN_ID


class AsyncDrafts:
    """The runner's drafts between two steps, by request id."""

    def __init__(self) -> None:
        self.drafts: dict[str, list[int]] = {}

    @staticmethod
    def are_placeholders(scheduled: list[int] | tuple[int, ...]) -> bool:
        return bool(scheduled) and all(t == PLACEHOLDER_TOKEN_ID for t in scheduled)

    def fill(self, req_id: str, scheduled: list[int], last_token: int) -> list[int]:
        """The drafts to feed in place of `scheduled` placeholders: the request's own,
        cut or padded to their number."""
        mine = self.drafts.get(req_id, [])[:len(scheduled)]
        pad = mine[-1] if mine else last_token
        return mine + [pad] * (len(scheduled) - len(mine))

    def store(self, sampled_req_ids, drafts: dict[str, list[int]]) -> None:
        """The proposer's drafts after a step, for the next steps of the requests that
        sampled in it; one that got none (not eligible, nothing proposed) keeps none."""
        for rid in sampled_req_ids:
            self.drafts[rid] = drafts.get(rid, [])

    def drop(self, req_id: str) -> None:
        """A request left the batch (finished or preempted): its drafts are stale."""
        self.drafts.pop(req_id, None)
