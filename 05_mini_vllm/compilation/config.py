"""How the model's forward pass is executed: compiled or eager, CUDA graphs or not.

vLLM counterpart: `vllm/config/compilation.py` (`CompilationConfig`,
`CompilationMode`, `CUDAGraphMode`) and `ModelConfig.enforce_eager`.

Two independent switches, as in vLLM:

* `mode` says what `torch.compile` does with the model's forward:
  NONE (0) runs it eagerly; STOCK_TORCH_COMPILE (1) hands the whole forward
  to `torch.compile`; VLLM_COMPILE (3) traces it once with Dynamo, splits the
  graph at every op named in `splitting_ops` (attention, with its KV write),
  compiles the pieces between them with the `backend` ("inductor") and runs
  the attention ops eagerly in between. DYNAMO_TRACE_ONCE (2) exists in vLLM
  as a stepping stone and is refused here.
* `cudagraph_mode` says which steps replay captured CUDA graphs:
  NONE; FULL (the whole forward of a pure-decode step, attention included,
  at each capture size); PIECEWISE (the compiled pieces between the
  attention ops, for any step of up to the largest capture size; needs
  VLLM_COMPILE); FULL_AND_PIECEWISE (FULL for pure-decode steps, PIECEWISE
  for the others; vLLM's default on CUDA).

Defaults: on CUDA, FULL graphs of the eager model (the eager tokens exactly,
4.7x faster batch-1 decode steps on an H200); on a CPU, NONE and eager: the
hand-fused CPU layer ops are within 10% of inductor at the Qwen3-0.6B shape in
bf16 (`benchmarks/bench_compile.py`), and compiling would cost seconds at every
start. `-O3` (VLLM_COMPILE, FULL_AND_PIECEWISE on CUDA) is the fastest GPU mode.

Invariants:
* every batch that runs under a graph is padded up to the smallest capture
  size >= its token count; the padded rows write no KV slot (slot -1);
* capture sizes are sorted, unique, >= 1 and <= max_cudagraph_capture_size;
* on a CPU there is nothing to capture: a graph mode still pads batches into
  the same static buffers and runs the same runnable eagerly in place of the
  replay, which is how the padded path is tested without a GPU.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields


class CompilationMode(enum.IntEnum):
    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


class CUDAGraphMode(enum.Enum):
    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    def has_full(self) -> bool:
        return self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE)

    def has_piecewise(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)


# The op the piecewise split happens at (registered in `models/attention.py`).
ATTENTION_OP = "mini_vllm::unified_attention_with_output"
BACKENDS = ("inductor", "eager")


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8 up to `max_size`
    (a padded step wastes at most 7 rows; fewer sizes capture faster)."""
    sizes = [s for s in (1, 2, 4) if s <= max_size] + list(range(8, max_size + 1, 8))
    return sizes if max_size in sizes or max_size < 8 else sorted(set(sizes + [max_size]))


def _enum(cls, value, name: str):
    if isinstance(value, cls):
        return value
    try:
        return cls[value] if isinstance(value, str) and cls is CompilationMode else cls(value)
    except (KeyError, ValueError):
        allowed = [m.name for m in cls] + ([int(m) for m in cls] if cls is CompilationMode else [])
        raise ValueError(f"compilation_config.{name} must be one of {allowed}, got {value!r}") from None


@dataclass
class CompilationConfig:
    mode: CompilationMode | int | str | None = None      # None: the device's default
    cudagraph_mode: CUDAGraphMode | str | None = None    # None: the device's default
    cudagraph_capture_sizes: list[int] | None = None     # None: default_capture_sizes(max size)
    max_cudagraph_capture_size: int | None = None        # None: min(max_num_seqs, 512), raised by sizes given
    splitting_ops: list[str] = field(default_factory=lambda: [ATTENTION_OP])
    backend: str = "inductor"                            # what compiles the pieces

    @classmethod
    def from_any(cls, value) -> "CompilationConfig":
        """None, a CompilationConfig, a dict of these fields, or an int (vLLM's `-O3`: the mode)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(mode=value)
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"compilation_config: unknown field(s) {unknown}; known: {sorted(known)}")
            return cls(**value)
        raise ValueError(f"compilation_config must be None, an int mode, a dict or a CompilationConfig, "
                         f"got {type(value).__name__}")

    def resolve(self, device_type: str, max_num_seqs: int, enforce_eager: bool) -> "CompilationConfig":
        """The concrete config for this engine (defaults filled, everything checked)."""
        cuda = device_type == "cuda"
        mode = _enum(CompilationMode, CompilationMode.NONE if self.mode is None else self.mode, "mode")
        if mode == CompilationMode.DYNAMO_TRACE_ONCE:
            raise ValueError("compilation_config.mode DYNAMO_TRACE_ONCE (2) is not supported: use NONE (0), "
                             "STOCK_TORCH_COMPILE (1) or VLLM_COMPILE (3)")
        if self.cudagraph_mode is None:
            graphs = CUDAGraphMode.FULL if cuda else CUDAGraphMode.NONE
            if cuda and mode == CompilationMode.VLLM_COMPILE:
                graphs = CUDAGraphMode.FULL_AND_PIECEWISE
        else:
            graphs = _enum(CUDAGraphMode, self.cudagraph_mode, "cudagraph_mode")
        if enforce_eager:
            if self.mode not in (None, 0, "NONE", CompilationMode.NONE) or graphs != CUDAGraphMode.NONE \
                    and self.cudagraph_mode is not None:
                raise ValueError("enforce_eager=True runs the model eagerly: leave compilation_config.mode and "
                                 f"cudagraph_mode unset or NONE, got mode={self.mode!r}, "
                                 f"cudagraph_mode={self.cudagraph_mode!r}")
            mode, graphs = CompilationMode.NONE, CUDAGraphMode.NONE
        if graphs.has_piecewise() and mode != CompilationMode.VLLM_COMPILE:
            raise ValueError(f"compilation_config.cudagraph_mode {graphs.name} captures the compiled pieces "
                             f"between attention ops: it needs mode VLLM_COMPILE (3), got {mode.name}")
        if self.backend not in BACKENDS:
            raise ValueError(f"compilation_config.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.splitting_ops, list) or not all(isinstance(s, str) for s in self.splitting_ops):
            raise ValueError(f"compilation_config.splitting_ops must be a list of op names, got {self.splitting_ops!r}")
        if mode == CompilationMode.VLLM_COMPILE and ATTENTION_OP not in self.splitting_ops:
            raise ValueError(f"compilation_config.splitting_ops must name {ATTENTION_OP!r} (the graph is split at "
                             f"attention), got {self.splitting_ops!r}")
        sizes = self.cudagraph_capture_sizes
        cap = self.max_cudagraph_capture_size
        for name, v in (("max_cudagraph_capture_size", cap),):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"compilation_config.{name} must be None or an int >= 1, got {v!r}")
        if sizes is not None:
            if not isinstance(sizes, (list, tuple)) or not sizes or not all(
                    isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
                raise ValueError("compilation_config.cudagraph_capture_sizes must be a non-empty list of ints >= 1, "
                                 f"got {sizes!r}")
            sizes = sorted(set(sizes))
            if cap is not None and sizes[-1] > cap:
                raise ValueError(f"compilation_config.cudagraph_capture_sizes must be <= max_cudagraph_capture_size "
                                 f"{cap}, got {sizes[-1]}")
            cap = sizes[-1] if cap is None else cap
        else:
            cap = min(max_num_seqs, 512) if cap is None else cap
            sizes = default_capture_sizes(cap)
        return CompilationConfig(mode=mode, cudagraph_mode=graphs, cudagraph_capture_sizes=list(sizes),
                                 max_cudagraph_capture_size=cap, splitting_ops=list(self.splitting_ops),
                                 backend=self.backend)

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest capture size >= num_tokens; None when the batch is larger than all."""
        for s in self.cudagraph_capture_sizes or ():
            if s >= num_tokens:
                return s
        return None
