"""`CUDAGraphWrapper`: capture a callable once per padded batch size, then replay it.

vLLM counterpart: `vllm/compilation/cuda_graph.py` (`CUDAGraphWrapper`,
`CUDAGraphEntry`). One wrapper serves either the whole forward pass (FULL)
or one compiled piece between two attention ops (PIECEWISE); the runner's
dispatcher says, through the forward context, which mode this step runs in.

Why graphs: a decode step of a 0.6B model launches a few hundred small
kernels; launched one by one from Python, the GPU waits on the host between
them (the first GPU check measured 37 ms of wall time around 4.4 ms of GPU
work at batch 1). A replay launches the whole recorded sequence at once.

Invariants (what makes a replay correct):
* a replay reads its inputs from the addresses they had at capture, so the
  callers pass views of persistent buffers (`worker/cudagraph_dispatcher.py`),
  and a piece's other inputs are outputs of earlier captured pieces;
  the wrapper records those addresses and refuses a replay whose inputs moved
  (a static buffer reallocated after capture would otherwise be read stale);
* a replay returns the tensor it produced at capture: its contents change on
  every replay, so the caller uses it before the next replay;
* all graphs share one memory pool, captured largest first, so the smaller
  graphs reuse the largest one's intermediate memory.

On a CPU nothing is captured: the wrapper runs the callable on the same
padded, static inputs (the stand-in for a replay that tests exercise).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from mini_vllm.compilation.config import CUDAGraphMode
from mini_vllm.forward_context import cudagraph_context

logger = logging.getLogger("mini_vllm")


@dataclass
class CUDAGraphEntry:
    num_tokens: int
    graph: torch.cuda.CUDAGraph | None = None
    output: object = None
    input_addresses: list[int] = field(default_factory=list)


class GraphPool:
    """The memory pool every graph of one runner captures into (one per device)."""

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        self.capturing = False  # True only inside the runner's capture_model()


def _addresses(args) -> list[int]:
    return [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]


class CUDAGraphWrapper:
    """Wraps `runnable`; in a step whose runtime mode is `mode`, replays the graph
    captured for the step's padded token count (capturing it first while the
    runner is capturing). In any other step it calls `runnable` directly."""

    def __init__(self, runnable, mode: CUDAGraphMode, device: torch.device, pool: GraphPool,
                 name: str = "forward") -> None:
        if mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(f"a CUDAGraphWrapper is FULL or PIECEWISE, got {mode}")
        self.runnable, self.mode, self.device, self.pool, self.name = runnable, mode, device, pool, name
        self.entries: dict[int, CUDAGraphEntry] = {}

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def __call__(self, *args):
        ctx = cudagraph_context()
        if ctx.runtime_mode != self.mode:
            return self.runnable(*args)
        n = ctx.batch.num_tokens
        entry = self.entries.get(n)
        if entry is None:
            if not self.pool.capturing:
                raise RuntimeError(f"{self.name}: no {self.mode.name} CUDA graph was captured for {n} tokens; "
                                   "the dispatcher must pad every graph step to a capture size")
            entry = self.entries[n] = CUDAGraphEntry(n)
            if not self.on_cuda:  # CPU: record the addresses only; every call runs eagerly
                entry.input_addresses = _addresses(args)
                return self.runnable(*args)
            return self._capture(entry, args)
        # On a CPU only a FULL step's inputs are static buffers; a piece's inputs there
        # are fresh tensors every step (nothing was captured to hold them in place).
        if (self.on_cuda or self.mode == CUDAGraphMode.FULL) and _addresses(args) != entry.input_addresses:
            raise RuntimeError(f"{self.name}: the inputs of the {n}-token {self.mode.name} graph moved since "
                               "capture (a static buffer was reallocated?); a replay would read stale memory")
        if not self.on_cuda:
            return self.runnable(*args)
        entry.graph.replay()
        return entry.output

    def _capture(self, entry: CUDAGraphEntry, args):
        # A first eager run outside the graph: lazy initialisation (cuBLAS handles,
        # Triton compiling a kernel variant) must not happen during capture.
        self.runnable(*args)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool.handle):
            output = self.runnable(*args)
        entry.graph, entry.output, entry.input_addresses = graph, output, _addresses(args)
        return output
