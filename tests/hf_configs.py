"""The random tiny Hugging Face configs of the model tests: one small shape
(2 layers, hidden 64) for every architecture, checked against `transformers`."""
from __future__ import annotations


def tiny_config(cls, **kw):
    """A tiny `cls` (a transformers config class); keyword arguments override
    the defaults. Vocab 97 is prime, so the vocab-parallel tables need padding
    for every tp > 1."""
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                max_position_embeddings=256, initializer_range=0.15, rms_norm_eps=1e-6)
    base.update(kw)
    return cls(**base)
