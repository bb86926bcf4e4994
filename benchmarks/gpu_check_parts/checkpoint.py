"""A Qwen3-0.6B-shaped checkpoint with random weights, written by `save_pretrained`.

No vLLM counterpart (vLLM benchmarks real checkpoints; `--load-format dummy`
gives random weights in memory). Nothing is downloaded: the config is
Qwen3-0.6B's published shape, the weights are random (HF's init, std 0.02,
RMSNorm weights drawn in [0.5, 1.5] so that their use shows), saved in bf16.

The config has no EOS token: the workload runs with `ignore_eos`, and HF's
`min_new_tokens` would otherwise mask EOS out of the oracle's logits.
"""
from __future__ import annotations

from pathlib import Path

import torch

# Qwen3-0.6B (config.json of the published model): 28 layers, hidden 1024,
# 16 query / 8 KV heads of 128, MLP 3072, vocab 151,936, tied embeddings.
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
# --small: the same architecture at a size the CPU (and Triton's interpreter) runs in seconds.
# A wider init than HF's 0.02 (as tests/hf_configs.py uses): at hidden 64 the logits would
# otherwise be so flat that the greedy check could not tell a wrong attention from bf16 noise.
TINY_QWEN3 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=4096,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, initializer_range=0.15)


def write_checkpoint(folder: Path, small: bool, device: str, seed: int = 0) -> dict:
    """Write config.json + model.safetensors (bf16) into `folder`; returns the shape used."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = TINY_QWEN3 if small else QWEN3_0_6B
    config = Qwen3Config(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):  # initialising 0.6B parameters on the GPU takes a second, not a minute
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    return {"architecture": "Qwen3ForCausalLM", "dtype": "bfloat16", "parameters": n_params, **shape}
