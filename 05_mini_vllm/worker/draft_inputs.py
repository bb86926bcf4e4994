"""The runner's side of n-gram and draft-model speculation: the next step's drafts.

vLLM counterpart: the n-gram and draft-model branches of
`GPUModelRunner.propose_draft_token_ids` (`vllm/v1/worker/gpu_model_runner.py`);
EAGLE's branch, which also needs the step's hidden states, is `eagle_inputs.py`.

After a step, each request that sampled and may use drafts (`spec_eligible`)
gets up to `k` drafts from the tokens known after it: Chapter 4's
`NgramProposer` takes the contexts in order, `speculative.proposers.
DraftModelProposer` takes them by request id (its KV is per request).
`k` is the runner's `num_drafts_after(batch size)`: the proposer's k, or less
under a batch-size schedule (`num_speculative_tokens_per_batch_size`). With
k = 0 nothing is proposed; the draft model feeds the tokens it missed at its
next call, so its KV needs no pass of its own meanwhile.
"""
from __future__ import annotations

from mini_vllm.spec_decode import NgramProposer
from mini_vllm.speculative.verifier import spec_eligible


def propose_drafts(runner, sampled: dict[str, list[int]], k: int) -> dict[str, list[int]]:
    """req_id -> its drafts (1..k tokens) for the next step; requests without drafts are left out."""
    if k == 0:
        return {}
    # Under asynchronous scheduling the runner appended this step's tokens already.
    reqs = {rid: runner.requests[rid].token_ids + ([] if runner.async_scheduling else toks)
            for rid, toks in sampled.items() if toks and spec_eligible(runner.requests[rid].sampling_params)}
    if not reqs:
        return {}
    if isinstance(runner.proposer, NgramProposer):
        drafts = dict(zip(reqs, runner.proposer.propose(list(reqs.values()))))
    else:
        drafts = runner.proposer.propose(reqs)
    return {r: d[:k] for r, d in drafts.items() if d}
