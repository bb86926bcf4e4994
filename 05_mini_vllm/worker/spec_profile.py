"""Measuring, at start-up, where speculative decoding stops paying.

vLLM counterpart: none; vLLM's `profile_run` (`vllm/v1/worker/gpu_model_runner.py`)
measures memory, not time. This feeds `spec_decode/engine/auto_schedule.py`, whose
docstring states the rule: drafting pays at batch size B while the mean
acceptance length exceeds c(B) = V(B) / T(B).

For B = 1, 2, 4, ... up to `max_num_seqs`, on dummy steps:
* T(B): the target's forward over B sequences of one token, and its LM head over B rows;
* V(B): the target's forward over B sequences of k + 1 tokens and its LM head over
  all B (k + 1) rows, plus the proposer's drafting:
  - EAGLE: the head over B (k + 1) rows (its pass 1), then k - 1 times over B rows,
    and the head's LM head k times over B rows;
  - a draft model: the same passes with the draft model;
  - n-gram: nothing (a lookup on the host).

Each time is the fastest of `REPEATS` calls after a warm-up call (a shape's first
call may compile); the calls of one B alternate (plain, verify, draft, plain, ...), so
that a slow spell of a shared machine hits all three alike. The ladder also stops once
its calls add up to `BUDGET_S` seconds (a large model on a CPU, where a step of many
rows takes seconds): batch sizes past the last measured one then draft nothing, the
conservative side, and the start-up log says so. Dummy steps write no KV (every slot -1) and read block 0, as
CUDA graph capture's do. The ladder stops after the first B whose c exceeds
k + 1: no acceptance pays there, and larger batches only cost more per draft.

Left out, so c errs low (the engine drafts a little more often than it should):
sampling and verification, the proposer's host-side glue, and attention over
long contexts (a dummy's context is at most k + 1 tokens).
"""
from __future__ import annotations

import logging
import time

import torch

from mini_vllm.forward_context import set_forward_context
from mini_vllm.spec_decode.engine.eagle_base import EagleProposerBase
from mini_vllm.spec_decode.engine.proposers import DraftModelProposer
from mini_vllm.worker.cudagraph_dispatcher import dummy_metadata

logger = logging.getLogger("mini_vllm")

REPEATS = 5
BUDGET_S = 10.0


def _best_times(fns: list, device: torch.device) -> list[float]:
    """The fastest of REPEATS calls of each of `fns`, called in turn, after a warm-up call each."""
    for fn in fns:
        fn()  # warm-up: a new shape may compile or allocate
    best = [float("inf")] * len(fns)
    for _ in range(REPEATS):
        for i, fn in enumerate(fns):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _dummy(num_seqs: int, q: int, block_size: int, num_blocks: int, device):
    md = dummy_metadata(num_seqs * q, num_seqs, block_size, device)
    md.validate(num_blocks, block_size)
    return md, torch.zeros(num_seqs * q, dtype=torch.long, device=device)


def _target_step(runner, num_seqs: int, q: int):
    md, ids = _dummy(num_seqs, q, runner.block_size, runner.cache_engine.num_gpu_blocks, runner.device)

    def run():
        runner.model.compute_logits(runner.model_forward(ids, ids, md))
    return run


def _proposer_pass(runner, num_seqs: int, q: int):
    """One pass of the proposer's model over num_seqs dummy sequences of q tokens, then its LM
    head over num_seqs rows; None for the n-gram lookup, which runs no model."""
    proposer, dev = runner.drafter.proposer, runner.device
    if isinstance(proposer, EagleProposerBase):
        bs, blocks = proposer.bs, proposer.num_cache_blocks
        hidden = torch.zeros(num_seqs * q, runner.model_config.hidden_size,
                             dtype=next(runner.model.parameters()).dtype, device=dev)

        def forward(md, ids):
            return proposer._run(md, ids, ids, hidden)
        logits = proposer.head.compute_logits
    elif isinstance(proposer, DraftModelProposer):
        bs, blocks = proposer.bs, proposer.caches[0][0].shape[0]

        def forward(md, ids):
            with set_forward_context(md):
                return proposer.draft(ids, ids)
        logits = proposer.draft.compute_logits
    else:
        return None
    md, ids = _dummy(num_seqs, q, bs, blocks, dev)
    return lambda: logits(forward(md, ids)[:num_seqs])


def _drafting(runner, num_seqs: int, k: int):
    """The proposer's passes for B = num_seqs requests (one over k + 1 tokens each, then k - 1
    over one), or None when it runs no model."""
    first = _proposer_pass(runner, num_seqs, k + 1)
    if first is None:
        return None
    step = _proposer_pass(runner, num_seqs, 1)

    def run():
        first()
        for _ in range(k - 1):
            step()
    return run


@torch.inference_mode()
def measure_break_even(runner, k: int, max_num_seqs: int) -> list[tuple[int, float]]:
    """[(B, c(B))] for B = 1, 2, 4, ..., up to max_num_seqs or the first c > k + 1."""
    out: list[tuple[int, float]] = []
    b, spent = 1, 0.0
    while True:
        draft = _drafting(runner, b, k)
        fns = [_target_step(runner, b, 1), _target_step(runner, b, k + 1)] + ([draft] if draft is not None else [])
        times = _best_times(fns, runner.device)
        spent += (REPEATS + 1) * sum(times)  # the warm-up and timed calls, each at least its best time
        out.append((b, sum(times[1:]) / times[0]))
        if out[-1][1] > k + 1 or b >= max_num_seqs:
            return out
        if spent > BUDGET_S:
            logger.info("speculative decoding: measuring stopped at batch size %d after about %.0f s; "
                        "larger batches draft nothing", b, spent)
            return out
        b = min(2 * b, max_num_seqs)
