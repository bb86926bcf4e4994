"""Attention backends: write this step's K/V into the paged cache, then attend.

vLLM counterparts: `vllm/v1/attention/backends/` (`flash_attn.py`,
`triton_attn.py`, `cpu_attn.py`; `FlashAttentionImpl.forward`) and the backend selector
`vllm/attention/selector.py` (`get_attn_backend`).

Every backend has one entry point, `forward(query, key, value, key_cache,
value_cache, md, scale, k_scale, v_scale)`, for a whole mixed batch (prefill
chunks and decodes together, laid out by the `AttentionMetadata` md):

1. it FIRST scatters the batch's new keys/values into the cache at
   `md.slot_mapping` (every token of every sequence), and
2. THEN attends over the whole batch at once (no per-sequence loop): one
   varlen kernel launch for "triton" and "cpu"; for "torch" one padded SDPA
   call per group (the prefill chunks, and the decodes bucketed by length).

An fp8 cache (the cache tensors' dtype, from `kv_cache_dtype`) is written
quantized, fp8(x / scale), and read dequantised, stored * scale, with the
layer's per-tensor k_scale / v_scale, on every backend (vLLM passes
`layer._k_scale_float` the same way); other caches take scale 1.0.

The order is an invariant, not a detail: a sequence may read blocks that
another sequence of the same step writes (a prefix-cache hit on blocks being
filled in this very step), and a prefill chunk reads its own fresh keys from
the cache. Both work only if the whole batch is written before anything reads.

Backends:
* "triton": the Triton kernels of `mini_vllm.kernels` (the GPU path); a small
  pure-decode batch takes the split-KV kernel (`paged_attention_split.py`);
* "cpu": the numba-compiled kernel `mini_vllm.kernels.cpu_paged_attention`,
  which reads K/V blocks in place (the CPU default: it skips the padded
  gather that "torch" copies every block into); its per-step metadata
  (`CPUAttentionMetadata`) is built once per step by `CPUAttentionMetadataBuilder`;
* "torch": vectorised PyTorch (`torch_attn.py`: one block-granular gather
  through the block tables and one masked `scaled_dot_product_attention` per
  group), checked against Chapter 1's per-sequence reference
  `mini_vllm.paged_attention.paged_attention_varlen`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from mini_vllm.attention import torch_attn
from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.kernels.kv_cache_dtype import as_bytes, quantize
from mini_vllm.paged_attention import reshape_and_cache as torch_reshape_and_cache

BACKEND_NAMES = ("torch", "triton", "cpu")


class TorchAttentionBackend:
    """Padded-batch attention in plain PyTorch (`mini_vllm.attention.torch_attn`):
    one plan per step, block-granular gathers, decodes bucketed by length."""

    name = "torch"
    # Host-side planning (lengths read back, per-group launches): never inside a CUDA graph.
    full_cudagraph_support = False

    def forward(self, query, key, value, key_cache, value_cache, md: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0):
        torch_reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping, k_scale, v_scale)
        return self.attend(query, key_cache, value_cache, md, scale, k_scale, v_scale)

    @staticmethod
    def attend(query, key_cache, value_cache, md: AttentionMetadata, scale: float, k_scale: float = 1.0,
               v_scale: float = 1.0):
        return torch_attn.attend(query, key_cache, value_cache, md, scale, k_scale, v_scale)


class TritonAttentionBackend:
    """Chapter 1's Triton kernels (`mini_vllm.kernels`): the GPU path, compiled
    on CUDA; on a CPU they run in Triton's interpreter (the tests serve whole
    models that way, slowly, to check this path without a GPU)."""

    name = "triton"
    # A pure-decode step's launches depend only on tensor shapes: a FULL graph may hold them.
    full_cudagraph_support = True

    def __init__(self) -> None:
        # Chosen: import the kernels now (on a CPU, selecting Triton's interpreter), before
        # torch.compile may import triton for inductor, after which the interpreter cannot be chosen.
        _kernels()

    def forward(self, query, key, value, key_cache, value_cache, md: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0):
        pa, split, cache_ops = _kernels()
        # The step's metadata is checked once (the first layer; the runner usually did it
        # already): the kernels' own argument checks read index tensors back to the host,
        # and 5-7 such waits per layer kept a GPU idle most of a decode step.
        md.validate(key_cache.shape[0], key_cache.shape[1])
        cache_ops.reshape_and_cache_unchecked(key, value, key_cache, value_cache, md.slot_mapping, k_scale, v_scale)
        if md.max_query_len == 1:
            # A pure-decode step: one program per (sequence, KV head) instead of a 64-row query
            # tile of which a decode fills GROUP rows; when that leaves SMs idle (a small batch),
            # each sequence's keys are split into segments reduced afterwards (FlashDecoding).
            # The segment count depends on shapes only, so a captured graph fixes it.
            segments = split.num_segments_for(query.shape[0], key_cache.shape[2], _parallelism(query.device))
            if segments > 1:
                return split.split_kv_launch(query, key_cache, value_cache, md.block_tables, md.seq_lens, scale,
                                             segments, k_scale=k_scale, v_scale=v_scale)
        return pa.paged_attention_unchecked(query, key_cache, value_cache, md.block_tables, md.cu_seqlens_q,
                                            md.seq_lens, scale, md.max_query_len == 1, k_scale, v_scale)


@functools.lru_cache(maxsize=None)
def _kernels():
    """The Triton backend's kernel modules, imported on first use: importing triton is slow and
    the other backends never need it; without CUDA, Triton's interpreter is selected first.
    Modules, not functions: a call looks its function up each time, so a patched one is seen."""
    from mini_vllm.kernels import prepare_triton

    prepare_triton()
    from mini_vllm.kernels import paged_attention, paged_attention_split, reshape_and_cache

    return paged_attention, paged_attention_split, reshape_and_cache


@functools.lru_cache(maxsize=None)
def _parallelism(device: torch.device) -> int:
    """The device's SM count (cores on a CPU), asked once: a property query per layer costs host time."""
    _kernels()
    from mini_vllm.kernels.paged_attention_split import device_parallelism

    return device_parallelism(device)


@dataclass
class CPUAttentionMetadata:
    """The cpu backend's own metadata of one step (vLLM: `CPUAttentionMetadata` in
    `vllm/v1/attention/backends/cpu_attn.py`), shared by every layer."""

    slots: torch.Tensor          # int64 cache slots of the tokens whose K/V is kept (no -1)
    real: torch.Tensor | None    # bool [num_tokens]: which tokens are kept; None: all of them
    # The kernel's plan of this batch: made by the first layer's `run_varlen`, reused by all.
    plans: dict = field(default_factory=dict)


class CPUAttentionMetadataBuilder:
    """Builds `CPUAttentionMetadata` once per step (vLLM:
    `CPUAttentionMetadataBuilder.build`). vLLM's runner calls its builders before
    the forward pass; here the step's first layer calls it, so the backend also
    works when called without a runner (tests, benchmarks)."""

    def build(self, md: AttentionMetadata, num_blocks: int, block_size: int) -> CPUAttentionMetadata:
        # The kernel has no bounds checks: a bad block id would read outside the
        # cache. Check the metadata once per step (every layer shares md), not per layer.
        md.validate(num_blocks, block_size)
        real = md.slot_mapping >= 0  # -1: a token whose K/V is not kept
        slots = md.slot_mapping.long()  # index_copy_ takes int64 indices
        if bool(real.all()):
            return CPUAttentionMetadata(slots, None)
        return CPUAttentionMetadata(slots[real], real)


class CpuAttentionBackend:
    """The numba-compiled CPU kernel (`mini_vllm.kernels.cpu_paged_attention`):
    one parallel launch over (sequence, KV head, query tile), blocks read in place."""

    name = "cpu"
    full_cudagraph_support = False  # a CPU kernel: nothing to capture
    builder = CPUAttentionMetadataBuilder()  # stateless: one for every layer

    def forward(self, query, key, value, key_cache, value_cache, md: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0):
        # Imported lazily: numba takes a moment to import and the other backends never need it.
        from mini_vllm.kernels.cpu_paged_attention import check_cpu_inputs, run_varlen

        cpu_md = md.backend_metadata
        if not isinstance(cpu_md, CPUAttentionMetadata):  # the step's first layer
            cpu_md = md.backend_metadata = self.builder.build(md, key_cache.shape[0], key_cache.shape[1])
        check_cpu_inputs(query, key_cache, value_cache)
        write_kv_in_place(key, value, key_cache, value_cache, cpu_md.slots, cpu_md.real, k_scale, v_scale)
        return run_varlen(query, key_cache, value_cache, md.block_tables, md.cu_seqlens_q, md.seq_lens, scale,
                          plan_cache=cpu_md.plans, k_scale=k_scale, v_scale=v_scale)


def write_kv_in_place(key, value, key_cache, value_cache, slots, real=None, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """Chapter 1's `reshape_and_cache` for contiguous caches: slot s is row s of
    the cache seen as [num_blocks * block_size, num_kv_heads, head_dim], so one
    `index_copy_` per cache writes the whole batch (faster than indexing by
    (block, offset) pairs: 115 -> 20 us for a 128-token decode step, 2.0 -> 0.58 ms
    for 2,048 tokens, one thread).
    `slots` are already checked and free of -1; `real` selects their rows. An fp8
    cache gets `quantize`'s bytes, copied as uint8 (torch has no CPU float8 index_copy_)."""
    if real is not None:
        key, value = key[real], value[real]
    key, value = quantize(key, k_scale, key_cache.dtype), quantize(value, v_scale, value_cache.dtype)
    as_bytes(key_cache).view(-1, *key_cache.shape[2:]).index_copy_(0, slots, as_bytes(key))
    as_bytes(value_cache).view(-1, *value_cache.shape[2:]).index_copy_(0, slots, as_bytes(value))


_BACKENDS = {"torch": TorchAttentionBackend, "triton": TritonAttentionBackend, "cpu": CpuAttentionBackend}


def get_attn_backend(name: str):
    """The backend called `name` (one of BACKEND_NAMES)."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    return _BACKENDS[name]()


def default_backend(device) -> str:
    """"triton" on CUDA (compiled kernels), "cpu" elsewhere: the compiled CPU
    kernel (the Triton interpreter is far too slow to serve a model on a CPU,
    and "torch" stays as the readable path)."""
    return "triton" if torch.device(device).type == "cuda" else "cpu"
