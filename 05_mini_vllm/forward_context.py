"""The forward context: this step's attention metadata, visible to every attention layer.

vLLM counterpart: `vllm/forward_context.py` (`set_forward_context`,
`get_forward_context`, `BatchDescriptor`). The runner sets the step's
`AttentionMetadata` (`mini_vllm.attention.metadata`) around the forward pass;
the model's attention layers read it from here instead of passing it down
through every module's `forward`, so model code stays shaped like the Hugging
Face code it mirrors.

It also says how this forward pass runs with respect to CUDA graphs
(`cudagraph_context()`): the runtime mode the runner's dispatcher chose
(NONE, PIECEWISE or FULL) and the padded token count. A `CUDAGraphWrapper`
(`compilation/cuda_graph.py`) replays or captures only when the mode is its
own, and keys its graphs by that token count.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.compilation.config import CUDAGraphMode


@dataclass(frozen=True)
class BatchDescriptor:
    """What a captured graph is keyed by: the (padded) token count, and whether
    every request decodes exactly one token (the shape a FULL graph assumes)."""

    num_tokens: int
    uniform_decode: bool = False


@dataclass(frozen=True)
class CUDAGraphContext:
    runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch: BatchDescriptor | None = None


_CURRENT: AttentionMetadata | None = None
_GRAPH = CUDAGraphContext()


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None,
                        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
                        batch_descriptor: BatchDescriptor | None = None):
    """Make `attn_metadata` the metadata of the forward pass run inside the block."""
    global _CURRENT, _GRAPH
    if cudagraph_runtime_mode != CUDAGraphMode.NONE and batch_descriptor is None:
        raise ValueError("a CUDA graph runtime mode needs the batch descriptor its graphs are keyed by")
    prev, prev_graph = _CURRENT, _GRAPH
    _CURRENT, _GRAPH = attn_metadata, CUDAGraphContext(cudagraph_runtime_mode, batch_descriptor)
    try:
        yield
    finally:
        _CURRENT, _GRAPH = prev, prev_graph


def get_forward_context() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("attention ran outside set_forward_context(...): the runner must "
                           "wrap every forward pass so attention knows the batch layout")
    return _CURRENT


def cudagraph_context() -> CUDAGraphContext:
    return _GRAPH
