"""Which steps replay CUDA graphs, and the persistent buffers their inputs live in.

vLLM counterparts: `vllm/v1/cudagraph_dispatcher.py` (`CudagraphDispatcher`)
and the persistent input buffers of `vllm/v1/worker/gpu_model_runner.py`
(`self.input_ids`, `self.positions`, the block table's and slot mapping's
device buffers), filled in place every step.

Dispatch (per step, from host-side facts only):
* FULL: a pure-decode step (one token per request) of at most the largest
  capture size, when the mode has FULL graphs: the whole forward replays;
* PIECEWISE: any other step of at most the largest capture size, when the
  mode has piecewise graphs: the compiled pieces replay, attention runs eagerly;
* NONE: everything else (a long prefill), eagerly or compiled without graphs.

Padding (invariants the tests check):
* a graph step's token count is padded up to the smallest capture size;
* padded rows write no KV slot (slot -1) and, in a FULL step, are one-token
  pseudo-sequences that read block 0 and whose outputs are dropped;
* the buffers are allocated once, before capture, and only written in place
  afterwards: a replay reads exactly these addresses.
"""
from __future__ import annotations

import numpy as np
import torch

from mini_vllm.attention.metadata import AttentionMetadata
from mini_vllm.compilation.config import CompilationConfig, CUDAGraphMode
from mini_vllm.forward_context import BatchDescriptor
from mini_vllm.kvcache.kv_cache_utils import cdiv
from mini_vllm.worker.prepare_inputs import compute_query_start_loc


class CudagraphDispatcher:
    def __init__(self, config: CompilationConfig) -> None:
        self.config = config

    def dispatch(self, num_tokens: int, uniform_decode: bool) -> tuple[CUDAGraphMode, BatchDescriptor | None]:
        mode = self.config.cudagraph_mode
        if mode == CUDAGraphMode.NONE:
            return CUDAGraphMode.NONE, None
        padded = self.config.padded_size(num_tokens)
        if padded is None:
            return CUDAGraphMode.NONE, None
        if uniform_decode and mode.has_full():
            return CUDAGraphMode.FULL, BatchDescriptor(padded, uniform_decode=True)
        if mode.has_piecewise():
            return CUDAGraphMode.PIECEWISE, BatchDescriptor(padded)
        return CUDAGraphMode.NONE, None


class StaticInputBuffers:
    """Device buffers for the largest capture size; every graph step is a view
    of their first `padded` rows (a view's address is its buffer's)."""

    def __init__(self, max_tokens: int, max_blocks: int, device: torch.device) -> None:
        kw = dict(device=device)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, **kw)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, **kw)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, **kw)
        # FULL graphs only (pure decode: one sequence per token).
        self.block_tables = torch.zeros((max_tokens, max_blocks), dtype=torch.int32, **kw)
        self.seq_lens = torch.ones(max_tokens, dtype=torch.int32, **kw)
        self.cu_seqlens_q = torch.arange(max_tokens + 1, dtype=torch.int32, **kw)  # never changes

    def fill_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, padded: int):
        """input ids and positions of this step, zero-padded to `padded` rows."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if padded > n:  # each operation costs the host a launch, even on an empty range
            self.input_ids[n:padded].zero_()
            self.positions[n:padded].zero_()
        return self.input_ids[:padded], self.positions[:padded]

    def fill_decode_metadata(self, md: AttentionMetadata, padded: int) -> AttentionMetadata:
        """A pure-decode step's metadata in the buffers, padded with one-token
        pseudo-sequences: seq_len 1 over block 0 (in range, so the kernels may
        read it) and slot -1 (nothing written)."""
        n = md.num_seqs
        if md.num_tokens != n or md.max_query_len != 1:
            raise ValueError("fill_decode_metadata takes a pure-decode step (one query token per sequence), "
                             f"got {md.num_tokens} tokens for {n} sequences")
        width = md.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block_tables has {width} columns, the static buffer {self.block_tables.shape[1]}")
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        # Columns past `width` keep older entries: the kernels read only the first
        # ceil(seq_len / block_size) of a row, all of them written here.
        self.block_tables[:n, :width].copy_(md.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        pad = padded - n
        if pad:
            self.slot_mapping[n:padded].fill_(-1)
            self.block_tables[n:padded, 0] = 0
            self.seq_lens[n:padded].fill_(1)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:padded], block_tables=self.block_tables[:padded],
            cu_seqlens_q=self.cu_seqlens_q[:padded + 1], seq_lens=self.seq_lens[:padded],
            max_query_len=1, max_seq_len=max(md.max_seq_len, 1),
            query_lens_cpu=[1] * padded, seq_lens_cpu=list(md.seq_lens_cpu) + [1] * pad)


def dummy_metadata(num_tokens: int, num_seqs: int, block_size: int, device) -> AttentionMetadata:
    """A batch for capture and profiling that writes nothing (every slot -1):
    `num_seqs` sequences sharing `num_tokens` queries (the last takes the
    remainder), each as long as its queries, every table entry block 0."""
    q = [num_tokens // num_seqs] * num_seqs
    q[-1] += num_tokens - sum(q)
    return AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=device),
        block_tables=torch.zeros((num_seqs, cdiv(max(q), block_size)), dtype=torch.int32, device=device),
        cu_seqlens_q=torch.from_numpy(compute_query_start_loc(np.asarray(q))).to(device),
        seq_lens=torch.tensor(q, dtype=torch.int32, device=device),
        max_query_len=max(q), max_seq_len=max(q), query_lens_cpu=q, seq_lens_cpu=list(q))
