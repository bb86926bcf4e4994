"""The C++ experts of a mixture-of-experts layer (`csrc/cpu_moe.h`): the parameter block,
the workspace, the call and the wake-up of the thread team.

vLLM counterpart: the CPU build's `cpu_fused_moe` op (csrc/cpu/, called by
`vllm/model_executor/layers/fused_moe/experts/cpu_moe.py`): one call per layer for all
its experts.

Why one call: a decode step gives each expert a few tokens. A product per expert (two per
expert, 32 experts, per layer) made the Python loop and, with two threads, a wake-up of
the thread team per product cost more than their arithmetic (the engine ran at 0.65x
vLLM's speed with two threads). Here the routing is sorted and the rows gathered in C++ on
the calling thread, then the team is woken once and its workers share the layer's items
(see cpu_moe.h).

Where it runs: where `cpu_layer_ops_native.linear` runs for both of the layer's weights
(its library, the build `cpu_native.isa()` picks; the caller, cpu_fused_moe.py, checks
`handles_linear` and packs the weights). The same library holds both entry points.

Invariants: the output's bits depend neither on the thread count nor on the other tokens'
routing (each value is one fixed sequence of operations: cpu_moe.h); the workspace is
reused between calls on a thread and grown when a call needs more, never shared between
threads.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch
from numba import njit, prange, types

from . import cpu_native, cpu_layer_ops_native as native_ops
from .cpu_runtime import use_torch_threads

# The parameter block's slots, in the order of `enum MoeParam` in csrc/cpu_moe.h.
PARAMS = ("dtype", "hidden", "hidden_stride", "tokens", "hidden_size", "inter", "top_k", "local_experts", "ids",
          "expert_map", "weights", "w13", "w2", "out", "index", "scratch")
LINE_SLOTS = 8  # kLine in cpu_moe.h: int64 slots per cache line

_entries: dict[str, ctypes._CFuncPtr] = {}  # build -> its mini_vllm_fused_moe, checked once


def _entry(isa: str) -> ctypes._CFuncPtr:
    """The build's planning entry point (the library is loaded by `cpu_native`)."""
    if isa not in _entries:
        lib = cpu_native.layer_ops_library(len(native_ops.PARAMS))
        takes = getattr(lib, f"mini_vllm_fused_moe_num_params_{isa}")()
        if takes != len(PARAMS):
            raise RuntimeError(f"csrc/cpu_moe.h takes {takes} parameters, {__name__} fills {len(PARAMS)}")
        fn = getattr(lib, f"mini_vllm_fused_moe_{isa}")
        fn.argtypes = (ctypes.c_void_p, ctypes.c_int64)
        fn.restype = None
        _entries[isa] = fn
    return _entries[isa]


_worker_avx512 = types.ExternalFunction("mini_vllm_fused_moe_worker_avx512", types.void(types.intp, types.int64))
_worker_avx2 = types.ExternalFunction("mini_vllm_fused_moe_worker_avx2", types.void(types.intp, types.int64))


@njit(cache=True, parallel=True)
def _fan_out_avx512(params, nthreads):
    """One C++ worker per thread; they share the items through the index's counter."""
    for w in prange(nthreads):
        _worker_avx512(params.ctypes.data, w)


@njit(cache=True, parallel=True)
def _fan_out_avx2(params, nthreads):
    """As _fan_out_avx512, for the AVX2 build."""
    for w in prange(nthreads):
        _worker_avx2(params.ctypes.data, w)


_FAN_OUT = {"avx512": _fan_out_avx512, "avx2": _fan_out_avx2}


def index_slots(pairs: int, local_experts: int) -> int:
    """int64 slots of the index workspace (cpu_moe.h's layout): up to a line before its first
    64-byte boundary, the item counter's line, the counters' line, pending and ready per
    expert, order and slot per pair, offsets (E + 1) and active per expert."""
    return 3 * LINE_SLOTS + 4 * local_experts + 2 * pairs + 1


def scratch_elements(pairs: int, hidden_size: int, inter: int) -> int:
    """Elements of the activations' scratch: xs and y [pairs, H], gate_up [pairs, 2I], act [pairs, I]."""
    return pairs * (2 * hidden_size + 3 * inter)


class _Workspace(threading.local):
    """Each thread's parameter block and workspace, kept between calls: a new 1 MB buffer
    per layer would be fresh pages, faulted in on every step."""

    def __init__(self) -> None:
        self.params = np.zeros(len(PARAMS), np.int64)
        self.address = self.params.ctypes.data
        self.index = np.zeros(0, np.int64)
        self.scratch = torch.empty(0, dtype=torch.uint8)

    def reserve(self, index_slots: int, scratch_bytes: int) -> None:
        if self.index.size < index_slots:
            self.index = np.zeros(index_slots, np.int64)
        if self.scratch.numel() < scratch_bytes:
            self.scratch = torch.empty(scratch_bytes, dtype=torch.uint8)


_workspace = _Workspace()


def fused_experts(hidden: torch.Tensor, packed13: torch.Tensor, packed2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [T, H] = the layer's experts (cpu_fused_moe's contract) on weights packed by
    `cpu_layer_ops_native.pack_linear_weight`, one expert per packed[e]; the caller has
    checked shapes and ids and that `handles_linear` takes both weights; out contiguous."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    local_experts, inter = packed13.shape[0], packed2.numel() // (packed2.shape[0] * hidden_size)
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    emap = None if expert_map is None else expert_map.to(torch.int32).contiguous()
    pairs = num_tokens * top_k
    ws = _workspace
    ws.reserve(index_slots(pairs, local_experts), scratch_elements(pairs, hidden_size, inter) * hidden.element_size())
    ws.params[:] = (native_ops.DTYPES[hidden.dtype], hidden.data_ptr(), hidden.stride(0), num_tokens, hidden_size,
                    inter, top_k, local_experts, ids.data_ptr(), 0 if emap is None else emap.data_ptr(),
                    weights.data_ptr(), packed13.data_ptr(), packed2.data_ptr(), out.data_ptr(),
                    ws.index.ctypes.data, ws.scratch.data_ptr())
    isa = cpu_native.isa()
    # Split only a call worth a wake-up of the team (as a linear's threshold): which thread
    # computes an item changes no bit.
    split = pairs * 3 * hidden_size * inter >= native_ops.SPLIT_MACS and torch.get_num_threads() > 1
    _entry(isa)(ws.address, 0 if split else 1)
    if split:
        _FAN_OUT[isa](ws.params, use_torch_threads())
