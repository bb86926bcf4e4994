"""Random Qwen3-MoE checkpoints (and a dense twin) for the differential test and the MoE benchmarks.

Written by transformers' `save_pretrained`, with the tiny target's tokenizer
(vocab 6,144), head dim 32 (vLLM's CPU attention needs >= 32). The router is
initialised wide (uniform +-1) so that routing is far from ties: two engines
whose matmuls round differently still pick the same experts.

`dense_twin` is a Qwen3 with the same attention and an MLP as wide as the k
active experts together (intermediate_size = k * moe_intermediate_size): equal
active parameters per token, the comparison seed 001 §2 makes.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from mini_vllm.course.tiny_models import model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BASE = dict(vocab_size=6144, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=2048, initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=0,
            eos_token_id=0, pad_token_id=1, tie_word_embeddings=False)
# name -> Qwen3MoeConfig arguments
MOE_KINDS = {
    # the differential test's two shapes
    "moe-e8-k2": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
    "moe-e64-k8": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_experts=64,
                       num_experts_per_tok=8, moe_intermediate_size=16, norm_topk_prob=False,
                       mlp_only_layers=[0]),
    # the benchmarks' CPU-sized model: 32 experts top-4, 25 M expert parameters in all, 3 M active
    "moe-bench": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_experts=32,
                      num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True),
}


def _finish(model, path: Path) -> Path:
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(model_path("tiny-py-target") / name, path)
    return path


def moe_checkpoint(folder: Path, kind: str, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**BASE, **MOE_KINDS[kind]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.uniform_(-1.0, 1.0)
    return _finish(model, Path(folder) / kind)


def dense_twin(folder: Path, kind: str, seed: int = 0) -> Path:
    """A dense Qwen3 with the MoE's attention and k * moe_intermediate_size MLP columns."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    moe = MOE_KINDS[kind]
    cfg = {k: v for k, v in moe.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                     "norm_topk_prob", "mlp_only_layers")}
    cfg["intermediate_size"] = moe["num_experts_per_tok"] * moe["moe_intermediate_size"]
    torch.manual_seed(seed)
    return _finish(AutoModelForCausalLM.from_config(Qwen3Config(**BASE, **cfg)), Path(folder) / f"{kind}-dense")
