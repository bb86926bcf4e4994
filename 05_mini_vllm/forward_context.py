"""The forward context: this step's attention metadata, visible to every attention layer.

vLLM counterpart: `vllm/forward_context.py` (`set_forward_context`,
`get_forward_context`). The runner sets the step's `AttentionMetadata`
(`mini_vllm.attention.metadata`) around the forward pass; the model's
attention layers read it from here instead of passing it down through every
module's `forward`, so model code stays shaped like the Hugging Face code it
mirrors.
"""
from __future__ import annotations

from contextlib import contextmanager

from mini_vllm.attention.metadata import AttentionMetadata


_CURRENT: AttentionMetadata | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None):
    """Make `attn_metadata` the metadata of the forward pass run inside the block."""
    global _CURRENT
    prev, _CURRENT = _CURRENT, attn_metadata
    try:
        yield
    finally:
        _CURRENT = prev


def get_forward_context() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("attention ran outside set_forward_context(...): the runner must "
                           "wrap every forward pass so attention knows the batch layout")
    return _CURRENT
