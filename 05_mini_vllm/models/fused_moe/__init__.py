"""Mixture-of-experts layers (`mini_vllm.models.fused_moe`).

vLLM counterpart: `vllm/model_executor/layers/fused_moe/`. `reference.py` is
the oracle every MoE implementation (Triton, CPU) is compared against.
"""
from mini_vllm.models.fused_moe.reference import fused_experts_reference, fused_topk_reference

__all__ = ["fused_experts_reference", "fused_topk_reference"]
