"""Which implementation a layer runs on the CPU: matmuls with each weight packed once
(the C++ kernel of `kernels/csrc/cpu_gemm.h`, or oneDNN's), and the
compiled fused ops of `kernels/cpu_layer_ops.py`.

vLLM counterpart: `vllm/model_executor/layers/utils.py`
(`dispatch_cpu_unquantized_gemm`), which gives every unquantized linear layer
on x86 a oneDNN matmul whose weight was reordered once, at load time, into
the blocked layout the matmul reads fastest (or, for small weights, the packed
bf16 GEMM of csrc/cpu/sgl-kernels, `weight_packed_linear`); and
`vllm/_custom_ops.py`, through which vLLM's layers call its CPU build's fused
norm, activation and rotary ops.

Why: `F.linear` hands the weight to the BLAS as it is, row-major [N, K], and
the BLAS repacks panels of it on every call. oneDNN's packed layout is done
once. On the 2-core test machine (fp32, tiny-py-target's shapes,
`benchmarks/bench_engine_layer_ops.py`) that makes a linear layer 1.06-1.42x
faster for a 128-row decode step (the lm_head gains most) and 1.10-1.17x for
a 2,048-token prefill, at one thread and at two; the linear layers are about
half of an engine step.

Why a kernel of our own: on a decode step (1-16 rows) oneDNN's bf16 matmul
read the weight at 7-12 GB/s on one Zen 4 core where the core streams 20-22
GB/s, and the linears are four fifths of a Qwen3-0.6B-shaped engine step. The
C++ kernel (VDPBF16PS on panels of 32 output columns, every row count the same
instruction sequence per output) reads 18-24 GB/s for 1 row, is 1.2x oneDNN
for 16 rows and level with it (210-220 GFLOP/s) on a prefill. In fp32 the
same loop on FMA gave oneDNN's bits for the tiny model's shapes at half the
cost of a small call. It runs where the C++ layer ops run (AVX-512 with BF16,
or AVX2 with FMA) for weights of N % 32 == 0 (and even K in bf16); other
weights, and CPUs with neither, keep oneDNN (kernels/NOTES.md has the
measurements).

On an AVX2-only CPU oneDNN packs no bf16 weight, and torch's bf16 matmul there
is slow; the C++ kernel's AVX2 build reads the bf16 weight as packed, widens
it in registers and accumulates in fp32, so a bf16 checkpoint's decode reads
half the bytes an fp32 copy would. A bf16 weight it does not take runs
`F.linear`.

Invariants:
* `linear(x, layer.weight, bias, layer)` equals `F.linear(x, weight, bias)`
  up to fp32 summation order (oneDNN and the C++ kernel order the K sum
  otherwise; in bf16 that rarely moves an output across a rounding boundary);
* the packed copy follows the weight: it is keyed on the weight's storage
  and its version counter, so a weight written in place after loading (a
  test zeroing a projection, a reload) is packed again on the next call,
  never read stale;
* used only where it can be: a CPU tensor in float32 or bfloat16, the C++
  kernel taking the shape, or else oneDNN present and packing the dtype (bf16
  needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: not on an AVX2-only CPU, whose
  other bf16 weights take `F.linear`), no autograd graph to record (the packed matmul has no backward),
  a weight with a version counter (one created under `torch.inference_mode`
  has none, so a stale copy could not be detected); anything else takes
  `F.linear`;
* `fused(x, *params)` says whether a layer may call the fused ops for x: float32
  or bfloat16 (parameters of the same dtype) on the CPU with no autograd graph
  to record (fp16 and GPUs keep the torch code, which is also the readable
  reference);
* under `torch.compile` (`torch.compiler.is_compiling()`, a constant while
  Dynamo traces) the fused ops are off: the traced graph holds the plain torch
  ops, which inductor fuses and `compilation/backends.py` splits at attention.
  The packed matmul stays, as the op `mini_vllm::packed_linear` (vLLM's
  compiled CPU models call `torch.ops._C.onednn_mm` the same way): inductor
  cannot pack a weight once, and without it a compiled bf16 model ran every
  linear layer through an unpacked matmul (Qwen3-0.6B's q/k/v projection for
  16 tokens: 0.75 ms packed, 1.13 ms unpacked, 1 thread, Zen 4). The op finds
  its layer by the name `register_owner` gave it: the graph holds a string,
  never the layer;
* `MINI_VLLM_CPU_OPS=torch` turns both off (`compiled`, the default, on), for
  a learner reading the torch path or bisecting a numeric difference; any
  other value is refused at import, naming the allowed ones.

Which matmul (`MINI_VLLM_CPU_LINEAR`): `auto` (the default) takes the C++ kernel where it
takes the shapes, except for bf16 weights on a CPU with AMX, which take oneDNN with
weights reordered once for AMX tiles (vLLM's `onednn_mm` on such CPUs: its tile
instructions do 16 x 32 bf16 products per instruction where VDPBF16PS does 16 x 2);
then oneDNN where it packs the dtype, then F.linear. `native`, `onednn` and `torch`
force one path on any CPU (for tests and benchmarks); `onednn` for a dtype oneDNN
cannot pack here (bf16 on an AVX2-only CPU) raises, naming the variable, rather than
running something else under that name.

Batch invariance: a row's result from the packed matmul does not depend on
how many rows share the call (which kernel runs is chosen by the layer and the
CPU, never by the row count), so a request's logits are the same bits alone or
in a batch (the engine's outputs do not depend on scheduling, which the core
process tests compare to 5 decimals). F.linear does not have this property: the
BLAS takes another kernel for 1 row than for several. It is faster for 1-2
rows of the tiny model's layers here (256 x 256: 7 against 18 us), but
switching paths by row count would make a request's tokens depend on its batch.

oneDNN's primitive cache: oneDNN builds (JIT-compiles) a matmul per weight
shape and row count and keeps the last 1,024 it built. The engine's row count
is the step's token count, which varies from step to step: the tiny
throughput workload makes 808 distinct (rows, weight) pairs per run, and a
workload past 1,024 rebuilds a primitive on almost every call (a 256 x 256
linear cycling through 1,300 row counts: 1,337 us a call, 614 us with room
for all of them). Before the first weight is packed, `linear` raises the
capacity to PRIMITIVE_CACHE_CAPACITY through ONEDNN_PRIMITIVE_CACHE_CAPACITY,
which oneDNN reads when it makes its first primitive: in a fresh engine
process that is in time; in a process that ran oneDNN before, the default
stays. A value the user set is kept.

Cost: the packed copy is held beside the dense weight (vLLM frees the dense
one; here tests and notebooks still read `layer.weight`), so a CPU model's
linear weights take twice their memory.
"""
from __future__ import annotations

import itertools
import os
import weakref

import torch
import torch.nn.functional as F

from mini_vllm.kernels import cpu_layer_ops_native as native_ops
from mini_vllm.kernels import cpu_native

_CHOICES = ("compiled", "torch")
CPU_OPS = os.environ.get("MINI_VLLM_CPU_OPS", "compiled")
if CPU_OPS not in _CHOICES:
    raise ValueError(f"MINI_VLLM_CPU_OPS must be one of {_CHOICES}, got {CPU_OPS!r}")

def _onednn_ok() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _onednn_bf16_ok() -> bool:
    """oneDNN packs bf16 weights only on CPUs with bf16 conversions (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT); on an AVX2-only CPU `_reorder_linear_weight` raises in the first step."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


_LINEAR_CHOICES = ("auto", "native", "onednn", "torch")
CPU_LINEAR = os.environ.get("MINI_VLLM_CPU_LINEAR", "auto")
if CPU_LINEAR not in _LINEAR_CHOICES:
    raise ValueError(f"MINI_VLLM_CPU_LINEAR must be one of {_LINEAR_CHOICES}, got {CPU_LINEAR!r}")

_AVAILABLE = _onednn_ok()
PRIMITIVE_CACHE_CAPACITY = 8192  # about 4 weight shapes x every row count up to a 2,048-token step
# The dtypes whose weights oneDNN can pack on this CPU.
PACKABLE = (torch.float32, torch.bfloat16) if _AVAILABLE and _onednn_bf16_ok() else (torch.float32,)
# The dtypes `linear` sends to `_packed_linear` (the C++ kernel, oneDNN or, for a bf16
# weight neither takes, F.linear); others take F.linear at once.
LINEAR_DTYPES = (torch.float32, torch.bfloat16)


def _packed_weight(owner, weight: torch.Tensor, native: bool) -> torch.Tensor:
    """The packed copy of `weight` for the C++ kernel (`native`) or for oneDNN, cached
    in `owner._packed` (a field every layer that calls `linear` declares) until the weight
    changes or the other kernel is asked for (the tests switch the C++ kernels off)."""
    key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape), native)
    cached = owner._packed
    if cached is None or cached[0] != key:
        # before oneDNN's first primitive in this process, if this is it (see the docstring)
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))
        with torch.no_grad():
            packed = (native_ops.pack_linear_weight(weight) if native
                      else torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        cached = (key, packed)
        owner._packed = cached
    return cached[1]


_state: dict[str, bool] = {}


def has_amx() -> bool:
    """AMX with bf16 tiles (Intel Sapphire Rapids and later); asked once per process."""
    if "amx" not in _state:
        _state["amx"] = cpu_native.host_has("amx-bf16")
    return _state["amx"]


def linear_path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """"native", "onednn" or "torch": the matmul a packed linear runs for this layer on
    this CPU (see `MINI_VLLM_CPU_LINEAR` above); never depends on the number of rows."""
    onednn = _AVAILABLE and x.dtype in PACKABLE
    if CPU_LINEAR == "torch":
        return "torch"
    if CPU_LINEAR == "onednn":
        if not onednn:
            raise RuntimeError(f"MINI_VLLM_CPU_LINEAR=onednn: oneDNN cannot pack a {x.dtype} weight on this CPU "
                               f"(packs {[str(d) for d in PACKABLE]}); use auto, native or torch")
        return "onednn"
    if CPU_LINEAR == "auto" and onednn and x.dtype == torch.bfloat16 and has_amx():
        return "onednn"
    if native_ops.handles_linear(x, weight):
        return "native"
    return "onednn" if onednn and CPU_LINEAR == "auto" else "torch"


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner) -> torch.Tensor:
    """x @ weight.T (+ bias) on a packed weight, through the matmul `linear_path` names."""
    path = linear_path(x, weight)
    if path == "native":
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        out = torch.empty((rows.shape[0], weight.shape[0]), dtype=x.dtype)
        native_ops.linear(rows, _packed_weight(owner, weight, True), None if bias is None else bias.float(), out)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])
    if path == "torch":  # e.g. bf16 on an AVX2-only CPU for a shape the C++ kernel does not take
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, _packed_weight(owner, weight, False), bias, "none", [], "")


# Layers that call `linear`, by name, for the op below (held weakly: a dropped model is freed).
_OWNERS: weakref.WeakValueDictionary[str, torch.nn.Module] = weakref.WeakValueDictionary()
_NEXT_OWNER = itertools.count()


def register_owner(owner: torch.nn.Module) -> str:
    """A process-unique name for a layer that calls `linear`, by which the compiled graph's
    `mini_vllm::packed_linear` finds its packed weight; the layer keeps it as `_packed_name`."""
    name = f"{type(owner).__name__}.{next(_NEXT_OWNER)}"
    _OWNERS[name] = owner
    return name


def _packed_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner: str) -> torch.Tensor:
    layer = _OWNERS.get(owner)
    if layer is None:
        raise RuntimeError(f"no live layer is named {owner!r} (mini_vllm::packed_linear)")
    if weight.is_inference():  # as in `linear`: no version counter to key a packed copy on
        return F.linear(x, weight, bias)
    return _packed_linear(x, weight, bias, layer)


# Registered as `models/attention.py` registers attention (a Library, not
# `torch.library.custom_op`, whose Python dispatch costs more per call).
_LIB = torch.library.Library("mini_vllm", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias, str owner) -> Tensor")
_LIB.impl("packed_linear", _packed_linear_op, "CPU")


@torch.library.register_fake("mini_vllm::packed_linear", lib=_LIB)
def _(x, weight, bias, owner):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _compiled_path(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """What the fused ops need: switched on, x on the CPU, no autograd graph to record,
    and not being traced by `torch.compile` (Dynamo cannot follow numba; inductor fuses
    the torch code itself). `linear` checks the same but for tracing, which it survives
    as an op of the graph."""
    return (CPU_OPS == "compiled" and x.device.type == "cpu" and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params))))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner) -> torch.Tensor:
    """x @ weight.T (+ bias); `owner` (the layer) holds the packed weight. `_packed_linear`
    picks the kernel at run time (the traced graph's op too, so that tracing never asks the
    C++ library anything)."""
    if (x.dtype in LINEAR_DTYPES and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and CPU_OPS == "compiled" and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        if torch.compiler.is_compiling():  # an op in the traced graph (Dynamo cannot ask is_inference)
            return torch.ops.mini_vllm.packed_linear(x, weight, bias, owner._packed_name)
        if not weight.is_inference():  # made under inference_mode: no version counter to key a copy on
            return _packed_linear(x, weight, bias, owner)
    return F.linear(x, weight, bias)


FUSED_DTYPES = (torch.float32, torch.bfloat16)


def fused(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """May a layer hand x (and its parameters, of x's dtype) to `kernels.cpu_layer_ops`?"""
    return (x.dtype in FUSED_DTYPES and all(p.dtype == x.dtype for p in params)
            and _compiled_path(x, *params))
