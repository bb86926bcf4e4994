"""Helpers shared by the tensor-parallel tests: random tiny checkpoints, per-rank
model builds without processes, and checks that no worker process is left."""
from __future__ import annotations

import multiprocessing
import time

import torch

from hf_configs import tiny_config
from mini_vllm.distributed import GroupCoordinator, use_tp_group
from mini_vllm.models import load_model


def _tiny(name, **kw):
    import transformers  # imported here: workers import this module for `fail_on_rank`

    return tiny_config(getattr(transformers, name), **kw)


# name -> config factory. qwen2 has ONE kv head: with tp = 2 or 4 it is replicated.
TP_CONFIGS = {
    "llama-gqa2-untied": lambda: _tiny("LlamaConfig", num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=False),
    "qwen2-kv1-tied": lambda: _tiny("Qwen2Config", num_attention_heads=4, num_key_value_heads=1,
                                    tie_word_embeddings=True),
    "qwen3-mha-bias-untied": lambda: _tiny("Qwen3Config", num_attention_heads=4, num_key_value_heads=4,
                                           head_dim=32, attention_bias=True, tie_word_embeddings=False),
}


def save_random_checkpoint(name: str, path, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(TP_CONFIGS[name]())
    with torch.no_grad():  # norms start at 1 and biases at 0: random ones make misuse visible
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(path)
    return path


def load_rank(path, rank: int, tp: int):
    """Rank `rank`'s shard of the model, built in this process (no group, no collectives)."""
    with use_tp_group(GroupCoordinator(rank=rank, world_size=tp)):
        model, _ = load_model(path, dtype=torch.float32)
    return model


def tp_children() -> list:
    """Live worker processes this process started (the engine names them mini_vllm-tp<rank>)."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("mini_vllm-tp")]


def wait_no_tp_children(timeout: float = 20.0) -> list:
    deadline = time.monotonic() + timeout
    while tp_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return tp_children()


def fail_on_rank(worker, rank: int) -> int:
    """For `collective_rpc`: raise inside rank `rank`'s worker process only."""
    if worker.tp_group.rank == rank:
        raise RuntimeError(f"injected failure on rank {rank}")
    return worker.tp_group.rank
