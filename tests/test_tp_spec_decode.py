"""Speculative decoding under tensor parallelism (TP = 2, gloo): the target is
sharded, the draft model is replicated. Oracle: the TP = 1 engine without drafts
(greedy verification is lossless, so the tokens must be the same)."""
from __future__ import annotations

import torch

from engine_utils import ALWAYS_DRAFT, make_llm, run_greedy
from mini_vllm.course.tiny_models import model_path
from tp_utils import wait_no_tp_children


def _prompts(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (5, 23, 41)]


def test_speculative_decoding_with_a_replicated_draft_model_matches_tp1():
    """The draft model is not sharded (it is built outside the rank's group): every
    rank runs it whole; rank 0's drafts reach all ranks through the SchedulerOutput."""
    spec = {"method": "draft_model", "model": str(model_path("tiny-py-draft")), "num_speculative_tokens": 3,
            **ALWAYS_DRAFT}
    prompts = _prompts(6144, 5)
    ref = run_greedy(make_llm(block_size=8), prompts, 16)
    two = make_llm(block_size=8, tensor_parallel_size=2, speculative_config=spec)
    try:
        got = run_greedy(two, prompts, 16)
        drafts = two.llm_engine.get_stats()["spec_num_drafts"]
    finally:
        two.shutdown()
    assert drafts > 0, "no drafts were proposed: the test exercised nothing"
    assert got == ref, "TP = 2 with speculative decoding changed the greedy tokens"
    assert not wait_no_tp_children(), "worker process left after shutdown"
