"""The random tiny Hugging Face configs of the model tests: one small shape
(2 layers, hidden 64) for every architecture, checked against `transformers`.

`RANDOM_CONFIGS` is shared by the model tests and the engine parity test.
transformers is imported only when a config is built: tensor-parallel workers
import this module (through tp_utils) and must start fast."""
from __future__ import annotations


def tiny_config(cls, **kw):
    """A tiny `cls` (a transformers config class); keyword arguments override
    the defaults. Vocab 97 is prime, so the vocab-parallel tables need padding
    for every tp > 1."""
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                max_position_embeddings=256, initializer_range=0.15, rms_norm_eps=1e-6)
    base.update(kw)
    return cls(**base)


def _tiny(name: str, **kw):
    """tiny_config of the transformers config class called `name`."""
    import transformers

    return tiny_config(getattr(transformers, name), **kw)


# name -> config factory; GQA ratios 1/2/4, tied and untied, llama3 rope scaling.
RANDOM_CONFIGS = {
    "llama-mha-untied": lambda: _tiny("LlamaConfig", num_attention_heads=4, num_key_value_heads=4,
                                      tie_word_embeddings=False),
    "llama3-rope-gqa2-tied": lambda: _tiny(
        "LlamaConfig", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2-gqa4-tied": lambda: _tiny("Qwen2Config", num_attention_heads=4, num_key_value_heads=1,
                                     tie_word_embeddings=True),
    "qwen3-gqa2-untied-bias": lambda: _tiny("Qwen3Config", num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=32, attention_bias=True, tie_word_embeddings=False),
}
