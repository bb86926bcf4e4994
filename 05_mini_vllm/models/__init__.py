"""Chapter 5 models (`mini_vllm.models`): Llama, Qwen2, Qwen3 on a paged KV cache.

vLLM counterparts: `vllm/model_executor/models/` (the architectures),
`vllm/model_executor/layers/` (norms, linears, rotary) and
`vllm/model_executor/model_loader/` (the loader).

Every model takes the flattened varlen batch (`input_ids`, `positions`, both
[T]) inside `set_forward_context(md)`, returns hidden states [T, hidden], and
exposes `compute_logits` and `attention_layers()` for the runner.
"""
from mini_vllm.models.attention import Attention, set_attention_backend
from mini_vllm.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from mini_vllm.models.llama import LlamaForCausalLM
from mini_vllm.models.loader import MODEL_REGISTRY, load_model
from mini_vllm.models.qwen2 import Qwen2ForCausalLM
from mini_vllm.models.qwen3 import Qwen3ForCausalLM

__all__ = [
    "Attention",
    "LlamaForCausalLM",
    "MODEL_REGISTRY",
    "ModelConfig",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SUPPORTED_MODEL_TYPES",
    "load_model",
    "set_attention_backend",
]
