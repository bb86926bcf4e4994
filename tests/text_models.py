"""A checkpoint whose greedy continuation is a text chosen by the test.

The tiny models only ever write ASCII Python, so the text path (incremental
detokenizer, streamed deltas) would never see a character split across
tokens. This helper writes a one-layer Llama (`save_pretrained`, the course
tokenizer copied beside it) that maps each token of a cycle to the next one:
attention and MLP outputs are zero, so the last hidden state is the current
token's embedding, a unit vector e_i for the i-th token of the cycle, and the
LM head row of token i + 1 is e_i. Greedy decoding then repeats the cycle
forever, through the real engine and the real server.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engine_utils import target_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_cycle_model(path, text: str, hidden_size: int = 64) -> list[int]:
    """Write the checkpoint to `path`; return the token ids of one cycle of
    `text` (greedy output after a prompt that ends with the cycle's last token)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(target_path()) / name, path / name)
    tok = AutoTokenizer.from_pretrained(str(path))
    cycle = tok.encode(text, add_special_tokens=False)
    if len(set(cycle)) != len(cycle) or len(cycle) > hidden_size:
        raise ValueError(f"text must tokenize to at most {hidden_size} distinct ids, got {cycle}")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for i, t in enumerate(cycle):
            model.model.embed_tokens.weight[t, i] = 1.0
            model.lm_head.weight[cycle[(i + 1) % len(cycle)], i] = 1.0
    model.save_pretrained(path)
    return cycle
