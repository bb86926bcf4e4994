"""`compile_forward`: the model's forward under `torch.compile`, whole or split at attention.

vLLM counterparts: `vllm/compilation/backends.py` (`VllmBackend`, which splits
the Dynamo graph with `split_graph` and compiles the pieces through a
`PiecewiseCompileInterpreter`), `vllm/compilation/piecewise_backend.py` (one
compiled piece) and `vllm/compilation/wrapper.py` (one Dynamo trace reused
for every batch size, guards dropped).

How VLLM_COMPILE works:
1. Dynamo traces `model(input_ids, positions)` once, with the token dimension
   of both inputs marked dynamic: the graph is written for a symbolic T;
2. the FX graph is cut before and after every call of an op in
   `splitting_ops` (`mini_vllm::unified_attention_with_output`): 2L+1 pieces
   for L layers, each attention call alone in its piece;
3. each other piece is compiled by inductor (or kept as FX code with
   backend="eager") for a symbolic T, then optionally wrapped by
   `piece_wrapper` (where CUDA-graph capture plugs in); attention pieces run
   eagerly, reading the step's metadata from the forward context.

Invariants:
* one compilation serves every token count >= 1. Dynamo would specialise a
  size of 1 and guard `T >= 2`; we trace with a hint of at least 2 and drop
  the shape-env guards (only that relation lives there; dtype, device,
  grad-mode and the static dims stay guarded), as vLLM drops all guards;
* attention metadata never enters a graph: the op reads it at run time;
* `splitting_ops` are never reordered or dropped: they mutate their output
  buffer, and the top-level split graph calls the pieces in program order;
* the hand-fused CPU ops step aside while Dynamo traces (`models/cpu_ops.py`):
  the graph holds plain torch ops, which inductor fuses itself.

Caching: inductor keeps compiled pieces in its FX graph cache (and AOTAutograd
its own) under `TORCHINDUCTOR_CACHE_DIR`; unset, we point it at
`$XDG_CACHE_HOME/mini_vllm/torch_compile` (default ~/.cache/...) rather than
torch's /tmp default, so a restart finds the pieces compiled. Dynamo itself
still traces on every new process (seconds).
"""
from __future__ import annotations

import inspect
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from mini_vllm.compilation.config import CompilationConfig, CompilationMode

logger = logging.getLogger(__name__)

PieceWrapper = Callable[[Callable, int, int], Callable]


def inductor_cache_dir() -> str:
    """Where inductor caches compiled code; set to a stable default when the user has not.
    Called when a model is compiled, not on import. Importing `torch._inductor` writes its own
    /tmp default into the environment, so that value counts as unset too (a user who sets
    exactly it gets ours)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "mini_vllm" / "torch_compile")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _op_name(target) -> str | None:
    """'ns::op' for a torch op (packet or overload) an FX node calls, else None."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return None


@dataclass
class Piece:
    """One piece of the split graph, in execution order."""
    name: str                  # the submodule's name in the split graph, e.g. "submod_3"
    is_splitting_op: bool      # True: an attention call, run eagerly
    num_nodes: int             # call nodes inside the piece (ops, methods, modules)
    layer_name: str | None     # the attention layer it calls (splitting pieces only)
    graph: torch.fx.GraphModule = field(repr=False)


@dataclass
class CompileStats:
    num_compilations: int = 0       # times Dynamo handed us a graph (1 unless something recompiled)
    backend_s: float = 0.0          # split + compiling the pieces (inside the Dynamo backend)
    first_call_s: float = 0.0       # first call: Dynamo trace + backend + one run
    pieces: list[Piece] = field(default_factory=list)
    dynamic_token_dim: bool = False  # the traced inputs had a symbolic token count


def split_graph(gm: torch.fx.GraphModule, splitting_ops: list[str]) -> tuple[torch.fx.GraphModule, list[Piece]]:
    """Cut `gm` around every call of a splitting op; returns the split module and its pieces."""
    part, ids = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and _op_name(node.target) in splitting_ops:
            part += 1           # the op gets a piece of its own ...
            ids[node] = part
            part += 1           # ... and what follows starts the next one
        else:
            ids[node] = part
    split = split_module(gm, None, lambda node: ids[node], keep_original_order=True)
    pieces = []
    for node in split.graph.nodes:  # program order = execution order
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        calls = [n for n in sub.graph.nodes if n.op.startswith("call_")]
        ops = [n for n in calls if _op_name(n.target) in splitting_ops]
        layer = ops[0].args[4] if ops and len(ops[0].args) > 4 else None
        pieces.append(Piece(node.target, bool(ops), len(calls), layer, sub))
    return split, pieces


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split graph on the trace's fake inputs, so each piece is compiled
    with example inputs of the right (symbolic) shapes; swaps in the compiled pieces."""

    def __init__(self, split: torch.fx.GraphModule, pieces: list[Piece], backend: str,
                 piece_wrapper: PieceWrapper | None):
        super().__init__(split)
        self.by_name = {p.name: p for p in pieces}
        self.backend, self.piece_wrapper = backend, piece_wrapper
        self.num_compiled = sum(not p.is_splitting_op for p in pieces)
        self.next_index = 0

    def call_module(self, target, args, kwargs):
        out = super().call_module(target, args, kwargs)  # fake run: the next piece's inputs
        piece = self.by_name[target]
        if piece.is_splitting_op:
            return out
        runnable: Callable = piece.graph
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx
            runnable = compile_fx(piece.graph, list(args))
        if self.piece_wrapper is not None:
            runnable = self.piece_wrapper(runnable, self.next_index, self.num_compiled)
        self.next_index += 1
        # The split graph's code calls `self.<name>(...)`: an instance attribute
        # shadows the submodule (kept in `_modules` for printing).
        self.module.__dict__[target] = runnable
        return out


_COMPILE_PARAMS = inspect.signature(torch.compile).parameters
_HINT_OVERRIDE = "hint_override" in inspect.signature(torch._dynamo.mark_dynamic).parameters


class CompiledForward:
    """`(input_ids, positions) -> hidden`, equal to `model(input_ids, positions)`;
    call it inside `set_forward_context(md)`, as the model."""

    def __init__(self, model: torch.nn.Module, config: CompilationConfig,
                 piece_wrapper: PieceWrapper | None = None):
        mode = CompilationMode(config.mode)
        if mode not in (CompilationMode.STOCK_TORCH_COMPILE, CompilationMode.VLLM_COMPILE):
            raise ValueError(f"compile_forward needs mode STOCK_TORCH_COMPILE or VLLM_COMPILE, got {mode.name}")
        if piece_wrapper is not None and mode != CompilationMode.VLLM_COMPILE:
            raise ValueError("piece_wrapper wraps the pieces of a split graph: it needs mode VLLM_COMPILE")
        self.model, self.config, self.mode = model, config, mode
        self.piece_wrapper = piece_wrapper
        self.stats = CompileStats()
        self.cache_dir = inductor_cache_dir()
        backend = self._split_backend if mode == CompilationMode.VLLM_COMPILE else self._stock_backend
        # isolate_recompiles (PyTorch >= 2.12): models of one class keep separate caches.
        extra = {"isolate_recompiles": True} if "isolate_recompiles" in _COMPILE_PARAMS else {}
        self._compiled = torch.compile(
            model, backend=backend, fullgraph=True, **extra,
            # Keep every guard but the shape env's (see the module docstring).
            options={"guard_filter_fn": lambda guards: [g.guard_type != "SHAPE_ENV" for g in guards]})

    def _note_graph(self, gm: torch.fx.GraphModule, example_inputs) -> None:
        self.stats.num_compilations += 1
        self.stats.dynamic_token_dim = any(isinstance(a, torch.SymInt) for a in example_inputs)

    def _stock_backend(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        self._note_graph(gm, example_inputs)
        t0 = time.perf_counter()
        compiled = compile_fx(gm, example_inputs)
        self.stats.backend_s += time.perf_counter() - t0
        return compiled

    def _split_backend(self, gm: torch.fx.GraphModule, example_inputs):
        self._note_graph(gm, example_inputs)
        t0 = time.perf_counter()
        split, pieces = split_graph(gm, self.config.splitting_ops)
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        # Dynamo hands real parameters beside fake inputs: make them all fake.
        fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs]
        with fake_mode:
            _PieceCompiler(split, pieces, self.config.backend, self.piece_wrapper).run(*fake_args)
        self.stats.pieces = pieces
        self.stats.backend_s += time.perf_counter() - t0
        return split

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for t in (input_ids, positions):
            # A hint of at least 2: Dynamo specialises a traced size of 1 (see module docstring).
            if _HINT_OVERRIDE:
                torch._dynamo.mark_dynamic(t, 0, hint_override=None if t.shape[0] >= 2 else 2)
            else:  # older PyTorch: a first call of 1 token would specialise (the engine's is larger)
                torch._dynamo.mark_dynamic(t, 0)
        if self.stats.num_compilations:
            return self._compiled(input_ids, positions)
        t0 = time.perf_counter()
        # Dynamic only where marked: Dynamo would otherwise also reuse what it
        # learnt about this forward's code from other models ("automatic dynamic").
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            out = self._compiled(input_ids, positions)
        self.stats.first_call_s = time.perf_counter() - t0
        logger.info("compiled %s (%s) in %.1f s (backend %.1f s); inductor cache: %s",
                    type(self.model).__name__, self.mode.name, self.stats.first_call_s,
                    self.stats.backend_s, self.cache_dir)
        return out

    def split_summary(self) -> str:
        """The pieces, in order, and where attention sits (VLLM_COMPILE, after the first call)."""
        if self.mode != CompilationMode.VLLM_COMPILE:
            return f"{self.mode.name}: one graph, not split"
        if not self.stats.pieces:
            return "not compiled yet: call it once (inside set_forward_context)"
        p = self.stats.pieces
        n_attn = sum(x.is_splitting_op for x in p)
        lines = [f"{len(p)} pieces: {len(p) - n_attn} compiled ({self.config.backend}), {n_attn} attention"]
        for i, x in enumerate(p):
            kind = f"attention  {x.layer_name}" if x.is_splitting_op else f"compiled   {x.num_nodes} nodes"
            lines.append(f"  {i:3d} {x.name:<10} {kind}")
        return "\n".join(lines)


def compile_forward(model: torch.nn.Module, compilation_config: CompilationConfig,
                    piece_wrapper: PieceWrapper | None = None) -> CompiledForward:
    """The compiled forward of `model` for `compilation_config.mode` (1 or 3).

    `piece_wrapper(runnable, index, num_pieces)` (VLLM_COMPILE only) receives each
    compiled non-attention piece, index 0..num_pieces-1 in execution order, and
    returns a callable with the same signature, called in its place."""
    return CompiledForward(model, compilation_config, piece_wrapper)
