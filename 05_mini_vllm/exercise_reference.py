"""Chapter 5 reference API: the names the engine tests exercise.

`tests/conftest.py` loads this module for `chapter("engine")` under
--impl=reference; `mini_vllm.exercise` exposes the same names, some as stubs.
"""
# ---- sampler filters ----
from mini_vllm.sample.ops.topk_topp import apply_min_p, apply_top_k_top_p

# ---- the runner: its inputs, then the runner itself ----
from mini_vllm.worker.model_runner import ModelRunner
from mini_vllm.worker.prepare_inputs import compute_positions, compute_query_start_loc, compute_slot_mapping

# ---- a mixture of experts' router ----
from mini_vllm.models.fused_moe.router import fused_topk

# ---- EAGLE's proposer, plugged into a real engine ----
from mini_vllm.spec_decode.engine.eagle import EagleProposer
from mini_vllm.entrypoints.llm import LLM as _LLM


def plug_eagle(llm: _LLM) -> None:
    """The reference's proposer is already in place: nothing to plug (the exercise's
    `plug_eagle` swaps in the learner's `EagleProposer`)."""


__all__ = ["EagleProposer", "ModelRunner", "plug_eagle", "apply_min_p", "apply_top_k_top_p", "compute_positions", "compute_query_start_loc",
           "compute_slot_mapping", "fused_topk"]
