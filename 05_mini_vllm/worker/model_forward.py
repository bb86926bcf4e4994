"""The runner's forward pass: eager, compiled, or replayed from CUDA graphs.

vLLM counterpart: the forward half of `vllm/v1/worker/gpu_model_runner.py`
(`_preprocess` + `_model_forward` under `set_forward_context` with the
dispatcher's runtime mode, `capture_model`, `_dummy_run`) and the model
compilation started by `vllm/compilation/decorators.py`.

`ModelForward(input_ids, positions, md)` returns the final hidden states of
the step's real tokens, whatever ran underneath:
* NONE: the model (or its compiled forward) on the step's own tensors;
* FULL: the step copied into the static buffers, padded to a capture size,
  and the whole forward replayed (on a CPU: run eagerly on those buffers);
* PIECEWISE: ids and positions padded in the static buffers; the compiled
  pieces between attention ops replay, attention runs on the real tokens.

`capture()` runs one dummy step per capture size, largest first, while the
graph pool is capturing; dummy steps write no KV slot. It runs after the KV
cache is allocated (a graph bakes the cache's addresses in) and before the
first request.
"""
from __future__ import annotations

import logging
import time

import torch

from mini_vllm.compilation.config import CompilationConfig, CompilationMode, CUDAGraphMode
from mini_vllm.compilation.cuda_graph import CUDAGraphWrapper, GraphPool
from mini_vllm.forward_context import set_forward_context
from mini_vllm.worker.cudagraph_dispatcher import CudagraphDispatcher, StaticInputBuffers, dummy_metadata

logger = logging.getLogger("mini_vllm")


def eager_config(device_type: str, max_num_seqs: int) -> CompilationConfig:
    return CompilationConfig().resolve(device_type, max_num_seqs, enforce_eager=True)


class ModelForward:
    def __init__(self, model, config: CompilationConfig, device: torch.device, max_blocks: int) -> None:
        self.model, self.config, self.device = model, config, device
        self.dispatcher = CudagraphDispatcher(config)
        graphs = config.cudagraph_mode != CUDAGraphMode.NONE
        self.pool = GraphPool() if graphs else None
        self.static = StaticInputBuffers(config.max_cudagraph_capture_size, max_blocks, device) if graphs else None
        self.forward_fn = model
        if config.mode != CompilationMode.NONE:
            from mini_vllm.compilation.backends import compile_forward

            wrap = None
            if config.cudagraph_mode.has_piecewise():
                def wrap(piece, index: int, num_pieces: int):
                    return CUDAGraphWrapper(piece, CUDAGraphMode.PIECEWISE, device, self.pool,
                                            name=f"piece {index}/{num_pieces}")
            self.forward_fn = compile_forward(model, config, piece_wrapper=wrap)
        self.full_graph = (CUDAGraphWrapper(self.forward_fn, CUDAGraphMode.FULL, device, self.pool)
                           if config.cudagraph_mode.has_full() else None)
        self.last_mode = CUDAGraphMode.NONE  # the runtime mode of the latest step (tests read it)
        self.capture_seconds = 0.0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, md) -> torch.Tensor:
        n = input_ids.shape[0]
        mode, batch = self.dispatcher.dispatch(n, uniform_decode=md.max_query_len == 1 and md.num_seqs == n)
        self.last_mode = mode
        if mode == CUDAGraphMode.NONE:
            with set_forward_context(md):
                return self.forward_fn(input_ids, positions)
        ids, pos = self.static.fill_tokens(input_ids, positions, batch.num_tokens)
        if mode == CUDAGraphMode.FULL:
            smd = self.static.fill_decode_metadata(md, batch.num_tokens)
            with set_forward_context(smd, mode, batch):
                hidden = self.full_graph(ids, pos)
        else:
            with set_forward_context(md, mode, batch):
                hidden = self.forward_fn(ids, pos)
        return hidden[:n]

    @torch.inference_mode()
    def capture(self, num_blocks: int, block_size: int, sizes: list[int] | None = None) -> None:
        """One dummy step per capture size (`sizes`: a subset, for the memory
        probe) and graph kind, largest first (the smaller graphs then reuse the
        largest one's pool memory)."""
        if self.pool is None:
            return
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        self.pool.capturing = True
        try:
            for size in sorted(sizes or self.config.cudagraph_capture_sizes, reverse=True):
                ids = torch.zeros(size, dtype=torch.long, device=self.device)
                kinds = [size] if self.full_graph is not None else []
                if self.config.cudagraph_mode.has_piecewise():
                    kinds.append(1)  # one sequence: not a pure-decode batch unless size == 1
                for num_seqs in kinds:
                    md = dummy_metadata(size, num_seqs, block_size, self.device)
                    md.validate(num_blocks, block_size)
                    self(ids, ids, md)
        finally:
            self.pool.capturing = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        used = free_before - torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        logger.info("captured %s CUDA graphs for %d sizes in %.1f s (%.2f GiB)", self.config.cudagraph_mode.name,
                    len(self.config.cudagraph_capture_sizes), self.capture_seconds, used / 2**30)
