"""Random tiny Qwen3-MoE checkpoints for the mixture-of-experts tests.

Each config is small (hidden 64, 2-3 layers) and mixes what the model must
honour: 8 experts top-2 and 64 narrow experts top-8, norm_topk_prob on and
off, dense layers from decoder_sparse_step and from mlp_only_layers.
transformers is imported only when a checkpoint is written (TP workers import
this module)."""
from __future__ import annotations

import torch

from hf_configs import tiny_config

# name -> Qwen3MoeConfig keyword arguments (over hf_configs.tiny_config's defaults)
MOE_CONFIGS = {
    # every layer sparse, weights renormalised
    "e8-k2-norm": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       num_hidden_layers=2, tie_word_embeddings=False),
    # layers 1 and 3 sparse (step 2), 0 and 2 dense; weights keep their softmax mass
    "e8-k2-step2": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                        num_hidden_layers=4, decoder_sparse_step=2, tie_word_embeddings=True),
    # 64 narrow experts top-8; layer 0 dense by mlp_only_layers
    "e64-k8-narrow-norm": dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=8,
                               norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[0],
                               tie_word_embeddings=False),
    "e64-k8-narrow-nonorm": dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=8,
                                 norm_topk_prob=False, num_hidden_layers=2, mlp_only_layers=[1],
                                 tie_word_embeddings=True),
}
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def moe_config(name: str, **kw):
    import transformers

    return tiny_config(transformers.Qwen3MoeConfig, **{**ATTENTION, **MOE_CONFIGS[name], **kw})


def save_random_moe(name: str, path, seed: int, **kw):
    """A random Qwen3-MoE checkpoint written by transformers' save_pretrained; returns `path`.
    Norms are random in [0.5, 1.5] and the router wide (uniform +-1), so that routing is
    far from ties and a wrong expert changes the logits visibly."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(moe_config(name, **kw))
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith("mlp.gate.weight"):
                p.uniform_(-1.0, 1.0)
    hf.save_pretrained(path)
    return path


def held_experts(worker) -> list[tuple[int, int, int]]:
    """For `collective_rpc`: (expert offset, local experts, intermediate columns) per sparse layer."""
    return [(m.expert_offset, m.local_num_experts, m.w2_weight.shape[-1]) for m in worker.model.moe_layers()]
