"""The C++ paged-attention kernel for fp32, bf16 and fp8 caches (`csrc/cpu_attn.cpp`): built, loaded, called;
and the build and load of the C++ layer ops' library (`csrc/cpu_layer_ops.cpp`, called by
`cpu_layer_ops_native.py`), which run where this kernel runs.

vLLM counterpart: vLLM's CPU build compiles `csrc/cpu/*.cpp` (its attention in
`cpu_attn.cpp` / `cpu_attn_impl.hpp`) into the `_C` extension when it is
installed, and its CPU attention backend calls that. Here the one source file
is compiled with `g++` on the first attention call it handles (about a second) into
the folder numba caches in, under a name that hashes the source and the flags,
so a fresh clone builds it once and an edit builds it again.

Why: a bf16 score is a dot product of two bf16 rows, which AVX512_BF16's VDPBF16PS
computes 32 pairs at a time; numba cannot emit it (see the C++ file's header). The
same file reads fp32 caches with FMAs, and its prefill tiles put a query row in each
SIMD lane. Against the numba kernel on a Xeon (family 6 model 167), one thread, L3
evicted (`bench_engine_attention.py`, kernels/NOTES.md): the qwen3-0.6b workload's bf16
decodes 1.24x and prefills 1.59x; the tiny workload's fp32 decodes 1.12x, prefills
1.47x.

fp8 caches (e4m3, e5m2, with per-tensor k_scale / v_scale; `kv_cache_dtype.py`) are read
by the same loops, each byte dequantised on load to fp32(value) * scale by bit arithmetic
(`csrc/attn_formats.h`; faster than numba's 256-entry table, which on AVX2 becomes a gather),
with a query and output of the model's dtype (fp32 or bf16).

Two builds (`ISAS`, best first). The sources are written against `csrc/simd.h`, a thin
layer of 16-lane operations with one header per instruction set, and compiled once per
set the CPU has: "avx512" (AVX-512 F / BW / VL / DQ + AVX512_BF16: VDPBF16PS, masked
loads) and "avx2" (AVX2 + FMA + F16C, the x86 laptops and desktops without AVX-512: 16 lanes as
two ymm registers, bf16 widened in registers and multiplied in fp32, in VDPBF16PS's
order, so both builds give the same bits but for fp32 denormals). Each build's symbols
carry its name (`mini_vllm_attn_worker_avx2`), so both can be loaded in one process.

Dispatch (`isa()`), at the first call: `use_isa(name)` inside its block (tests force each
build the CPU can run), else `MINI_VLLM_CPU_ATTN` (`avx512` or `avx2` forces that build,
`numba` none: the layer ops stay in numba too), else ("auto") the first of `ISAS` whose
features the CPU has (LLVM's view of the host, as numba's). Where numba targets another CPU
(`NUMBA_CPU_NAME`, as `cpu_runtime.AVX2_ONLY_ENV` holds an AVX-512 machine to AVX2), only the
AVX2 build may run. It also needs a C++ compiler ($CXX or g++); per call (`handles`), an
fp32 or bf16 cache with a query of its dtype, or an fp8 cache with an fp32 or bf16 query, a
head_dim that is a multiple of 16 (32 for bf16), and (`scales_ok`) fp8 scales below 2**120. Everything else runs the
numba kernel, which stays the reference implementation on every CPU. A failed build is
reported once (a warning with the compiler's message) and the numba kernel runs instead.

Threads: the work items, their order and the shared counter are the numba
kernel's (`cpu_paged_attention.plan_items`); numba's prange starts one C++
worker per thread (`_fan_out`), each taking items from the counter until none
is left. With one thread the worker is called directly.

Invariants: the same results, bit for bit, whatever the thread count or the
split of decodes into items (each query row's arithmetic is fixed); the output
has the cache's dtype, bf16 rounded to nearest even from the fp32 accumulator.
The two builds agree bit for bit but for fp32 denormals (VDPBF16PS flushes them);
the tests hold each build to the same oracles.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import numba
import torch
from llvmlite import binding as llvm_binding
from numba import njit, prange, types

from .kv_cache_dtype import is_fp8

logger = logging.getLogger("mini_vllm")

SOURCE = Path(__file__).resolve().with_name("csrc") / "cpu_attn.cpp"
# The builds, best first: each one's compiler flags, and LLVM's names for the CPU features
# those flags let the compiler use (csrc/simd.h picks the header by the same flags).
ISAS = {
    "avx512": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"),
               ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16", "fma")),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
}
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")  # exports: simd.h
# The fused layer ops (`csrc/cpu_layer_ops.cpp`, called by cpu_layer_ops_native.py), a library
# of their own because they need other flags: no product and sum contracted into an FMA (they
# round where torch rounds; g++ contracts by default, which the attention kernel's scalar code
# keeps), -fno-trapping-math so that GCC vectorises their exp's float -> int conversion, and
# OpenMP's simd pragmas (no OpenMP runtime) for the vectorised sums.
LAYER_OPS_SOURCE = SOURCE.with_name("cpu_layer_ops.cpp")
LAYER_OPS_EXTRA_FLAGS = ("-ffp-contract=off", "-fno-trapping-math", "-fopenmp-simd")


def flags(isa: str) -> tuple[str, ...]:
    """The attention kernel's compiler flags for one build."""
    return (*BASE_FLAGS, *ISAS[isa][0])


def layer_ops_flags(isa: str) -> tuple[str, ...]:
    return (*flags(isa), *LAYER_OPS_EXTRA_FLAGS)


# The cache dtypes it reads (`enum Dtype` in the C++ file), and the head_dim each needs a
# multiple of: one VDPBF16PS takes 32 bf16 of a row, one FMA 16 fp32 (an fp8 row is
# dequantised 16 bytes at a time). The queries it takes: the cache's dtype, and for an fp8
# cache either of QUERY_DTYPES (the model's).
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
HEAD_DIM_MULTIPLE = {torch.float32: 16, torch.bfloat16: 32, torch.float8_e4m3fn: 16, torch.float8_e5m2: 16}
QUERY_DTYPES = (torch.float32, torch.bfloat16)
# An e4m3 byte is read as its value times 2**-8, then multiplied by scale * 2**8 (csrc/attn_formats.h):
# the same fp32 product as value * scale while scale * 2**8 is finite in fp32.
MAX_FP8_SCALE = 2.0 ** 120

# The parameter block's slots, in the order of `enum Param` in the C++ file.
PARAMS = ("query", "key_cache", "value_cache", "out", "tables", "table_stride", "cu_seqlens", "seq_lens",
          "item_seq", "item_t0", "item_h0", "num_items", "tile_tokens", "decode_heads", "num_heads",
          "num_kv_heads", "head_dim", "block_size", "scale_bits", "scratch", "scratch_floats", "counter", "dtype",
          "k_scale_bits", "v_scale_bits", "query_dtype")

_CHOICES = ("auto", *ISAS, "numba")
CPU_ATTN = os.environ.get("MINI_VLLM_CPU_ATTN", "auto")
if CPU_ATTN not in _CHOICES:
    raise ValueError(f"MINI_VLLM_CPU_ATTN must be one of {_CHOICES}, got {CPU_ATTN!r}")


def scratch_floats(rows: int, head_dim: int, block_size: int) -> int:
    """Per-thread scratch of an item of `rows` query rows, in floats, as the C++ side lays
    it out, the larger of its two paths: attend_item's query pointers (two floats each),
    acc [rows, head_dim], S [rows, block_size], running max, sum and alpha [rows]; and
    attend_tile's, with rows padded to 16 lanes: pointers, transposed q and acc [head_dim,
    rows], max and sum, P [block_size, 16] and a block of V and of K in fp32 (K: an fp8
    cache's). Even, so that every thread's pointers stay 8-byte aligned."""
    n = rows * (2 + head_dim + block_size + 3)  # attend_item
    rows_p = -(-rows // 16) * 16
    n = max(n, rows_p * (2 + 2 * head_dim + 2) + 16 * block_size + 2 * block_size * head_dim)  # attend_tile
    return n + (n & 1)


_numba_only_depth = 0  # > 0 inside `numba_only()`


@contextlib.contextmanager
def numba_only():
    """Within the block every call runs the numba kernel: for the tests and benchmarks that
    compare the two, and for the numba kernel's own tests on a CPU that has this one."""
    global _numba_only_depth
    _numba_only_depth += 1
    try:
        yield
    finally:
        _numba_only_depth -= 1


_forced_isa: list[str] = []  # use_isa's blocks, innermost last


@contextlib.contextmanager
def use_isa(name: str):
    """Within the block the C++ calls run build `name` of `ISAS` (where the CPU cannot run
    it, `handles` is False and numba runs): how the tests run every build this CPU has."""
    if name not in ISAS:
        raise ValueError(f"unknown build {name!r}: one of {tuple(ISAS)}")
    _forced_isa.append(name)
    try:
        yield
    finally:
        _forced_isa.pop()


def _host_features() -> frozenset[str]:
    if "features" not in _state:
        _state["features"] = frozenset(
            f[1:] for f in llvm_binding.get_host_cpu_features().flatten().split(",") if f.startswith("+"))
    return _state["features"]


def host_has(feature: str) -> bool:
    """Does this CPU have LLVM's feature `feature` (e.g. "amx-bf16", "avx512bf16")?"""
    return feature in _host_features()


def isa() -> str | None:
    """The build C++ calls take now (see the module docstring), or None: numba's."""
    if _forced_isa:
        return _forced_isa[-1]
    if CPU_ATTN != "auto":
        return None if CPU_ATTN == "numba" else CPU_ATTN
    # Chosen once per process (the CPU does not change, and numba reads NUMBA_CPU_NAME once):
    # every layer op asks, and a decode step makes about 40 calls.
    if "auto" not in _state:
        _state["auto"] = next((name for name in ISAS if _isa_reason(name) is None), None)
    return _state["auto"]


def available_isas() -> tuple[str, ...]:
    """The builds this process can run (before any build is tried), best first."""
    return tuple(name for name in ISAS if unavailable_reason(name) is None)


def handles(dtype: torch.dtype, head_dim: int, query_dtype: torch.dtype | None = None) -> bool:
    """Does the C++ kernel run this call (not switched off, the library loaded, a cache dtype,
    query dtype (default: the cache's) and head_dim it reads)? An fp8 call also needs
    `scales_ok`."""
    query_dtype = dtype if query_dtype is None else query_dtype
    pair = query_dtype in QUERY_DTYPES if is_fp8(dtype) else query_dtype == dtype
    return (not _numba_only_depth and dtype in DTYPES and pair and head_dim % HEAD_DIM_MULTIPLE[dtype] == 0
            and library() is not None)


def scales_ok(k_scale: float, v_scale: float) -> bool:
    """Do the C++ kernel's fp8 reads give value * scale for these scales (see MAX_FP8_SCALE)?
    Larger ones (no checkpoint has them) take the numba kernel."""
    return k_scale < MAX_FP8_SCALE and v_scale < MAX_FP8_SCALE


def unavailable_reason(name: str | None = None) -> str | None:
    """Why this process cannot run build `name` (default: the one `isa()` picks), or None
    when it can (the build is tried on the first call; a failed build also sends calls to
    numba)."""
    if CPU_ATTN == "numba" and not _forced_isa:
        return "MINI_VLLM_CPU_ATTN=numba"
    if name is None:
        name = isa()
        if name is None:  # auto, and no build runs here: say why the simplest one does not
            return _isa_reason(list(ISAS)[-1])
    reason = _isa_reason(name)
    if reason is None and shutil.which(_compiler()) is None:
        return f"no C++ compiler ({_compiler()!r}; set CXX)"
    return reason


def _isa_reason(name: str) -> str | None:
    """Why the CPU (as numba targets it) cannot run build `name`, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    cpu_name = os.environ.get("NUMBA_CPU_NAME", "host")
    if cpu_name != "host" and name != "avx2":  # numba told to target another CPU: an ISA held back
        return f"NUMBA_CPU_NAME={cpu_name} (the kernels target that CPU, not this one: only the avx2 build runs)"
    missing = [f for f in ISAS[name][1] if f not in _host_features()]
    if missing:
        return f"the CPU lacks {', '.join(missing)} (the {name} build)"
    return None


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _build_dir() -> Path:
    """Where numba caches the kernels (see cpu_runtime._configure_numba), in a `native`
    subfolder; a per-user temp folder where that is not writable."""
    base = Path(numba.config.CACHE_DIR) if numba.config.CACHE_DIR else SOURCE.parent.parent / "__pycache__"
    for folder in (base / "native", Path(tempfile.gettempdir()) / f"mini_vllm_native_{os.getuid()}"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    raise OSError("no writable folder for the compiled kernel")


def _build(source_path: Path, flags: tuple[str, ...]) -> Path:
    """The compiled library, built if this source and these flags have not been: written
    under a temporary name and renamed, so concurrent builders never load half a file."""
    # The source and every header beside it (simd.h and its per-ISA headers, which both libraries include).
    source = b"".join(p.read_bytes() for p in (source_path, *sorted(source_path.parent.glob("*.h"))))
    digest = hashlib.sha256(source + " ".join((_compiler(), *flags)).encode()).hexdigest()[:16]
    target = _build_dir() / f"{source_path.stem}-{digest}.so"
    if not target.is_file():
        tmp = target.with_name(f"{target.stem}.{os.getpid()}.tmp.so")
        cmd = [_compiler(), *flags, str(source_path), "-o", str(tmp)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
        os.replace(tmp, target)
    return target


_lock = threading.Lock()
# ("attn" | "layer_ops", build): the loaded ctypes library, or None once loading failed;
# "features": the host CPU's features
_state: dict = {}


def library() -> ctypes.CDLL | None:
    """The loaded kernel library of the build `isa()` picks, built on its first call; None
    where it cannot run (`unavailable_reason`) or its build failed (logged once, as a
    warning). Its worker is `lib.worker`."""
    name = isa()
    key = ("attn", name)
    if key not in _state:
        with _lock:
            if key not in _state:
                lib = _load(SOURCE, name, flags, "mini_vllm_attn_num_params", len(PARAMS),
                            "the C++ attention kernel is unavailable, using the numba kernel")
                if lib is not None:
                    lib.worker = getattr(lib, f"mini_vllm_attn_worker_{name}")
                    lib.worker.argtypes = (ctypes.c_void_p, ctypes.c_int64)
                    lib.worker.restype = None
                _state[key] = lib
    return _state[key]


def layer_ops_library(num_params: int) -> ctypes.CDLL | None:
    """The fused layer ops' library (`csrc/cpu_layer_ops.cpp`) of the build `isa()` picks, as
    `library()`; the caller fills `num_params` slots per call (checked against the library at
    load). Its entry points are `lib.layer_op` and `lib.isa`."""
    name = isa()
    key = ("layer_ops", name)
    if key not in _state:
        with _lock:
            if key not in _state:
                lib = _load(LAYER_OPS_SOURCE, name, layer_ops_flags, "mini_vllm_layer_op_num_params", num_params,
                            "the C++ layer ops are unavailable, using numba's")
                if lib is not None:
                    lib.layer_op = getattr(lib, f"mini_vllm_layer_op_{name}")
                    lib.layer_op.argtypes = (ctypes.c_void_p, ctypes.c_int64)
                    lib.layer_op.restype = ctypes.c_int64
                    lib.isa = name
                _state[key] = lib
    return _state[key]


def _load(source: Path, name: str | None, flags_of, params_symbol: str, num_params: int,
          failure: str) -> ctypes.CDLL | None:
    if name is None or unavailable_reason(name) is not None:
        return None
    try:
        path = _build(source, flags_of(name))
        lib = ctypes.CDLL(str(path))
        takes = getattr(lib, f"{params_symbol}_{name}")()
        if takes != num_params:
            raise RuntimeError(f"{path} takes {takes} parameters, the Python side fills {num_params}: "
                               "the two files disagree")
        llvm_binding.load_library_permanently(str(path))  # so numba's _fan_out finds the worker by name
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("%s: %s", failure, e)
        return None
    return lib


# Each build's worker, declared by name for numba: linked against the library loaded above.
_worker_avx512 = types.ExternalFunction("mini_vllm_attn_worker_avx512", types.void(types.intp, types.int64))
_worker_avx2 = types.ExternalFunction("mini_vllm_attn_worker_avx2", types.void(types.intp, types.int64))


@njit(cache=True, parallel=True)
def _fan_out_avx512(params, nthreads):
    """One C++ worker per thread; they share the items through the params' counter."""
    for w in prange(nthreads):
        _worker_avx512(params.ctypes.data, w)


@njit(cache=True, parallel=True)
def _fan_out_avx2(params, nthreads):
    """As _fan_out_avx512, for the AVX2 build (numba binds a worker by its name)."""
    for w in prange(nthreads):
        _worker_avx2(params.ctypes.data, w)


_FAN_OUT = {"avx512": _fan_out_avx512, "avx2": _fan_out_avx2}


def run(query, key_cache, value_cache, out, tables: np.ndarray, cu: np.ndarray, seq_lens: np.ndarray,
        item_seq: np.ndarray, item_t0: np.ndarray, item_h0: np.ndarray, tile_tokens: int, decode_heads: int,
        scale: float, nthreads: int, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """out = attention over the plan's items (see cpu_paged_attention.run_varlen, which
    checked everything): query, caches and out contiguous tensors that `handles` (out of the
    query's dtype); tables, cu and seq_lens integer numpy arrays, the items int64 ones (the
    plan's); k_scale / v_scale an fp8 cache's (`scales_ok`)."""
    params, _arrays = attention_params(query, key_cache, value_cache, out, tables, cu, seq_lens, item_seq, item_t0,
                                       item_h0, tile_tokens, decode_heads, scale, nthreads, k_scale, v_scale)
    run_params(params, nthreads)


# The slots of `attention_params` a caller rewrites to run one step's plan on another layer
# (models/cpu_step.py): the query, both caches and the output; COUNTER_SLOT holds the address
# of the item counter, which must be zero before each run.
LAYER_SLOTS = slice(0, 4)
COUNTER_SLOT = 21
SCALE_SLOTS = slice(PARAMS.index("k_scale_bits"), PARAMS.index("v_scale_bits") + 1)  # an fp8 layer's (scale_slots)


def scale_slots(k_scale: float, v_scale: float) -> tuple[int, int]:
    """What SCALE_SLOTS hold for an fp8 cache's scales."""
    return _bits(k_scale), _bits(v_scale)


def attention_params(query, key_cache, value_cache, out, tables: np.ndarray, cu: np.ndarray, seq_lens: np.ndarray,
                     item_seq: np.ndarray, item_t0: np.ndarray, item_h0: np.ndarray, tile_tokens: int,
                     decode_heads: int, scale: float, nthreads: int, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> tuple[np.ndarray, tuple]:
    """The C++ kernel's parameter block for `run`'s arguments, and the arrays its pointers
    point into (the caller keeps them alive while the block is used)."""
    # The C++ side reads int32 tables and lengths (the engine's dtype; tests may pass int64).
    tables, cu, seq_lens = (np.ascontiguousarray(a, np.int32) for a in (tables, cu, seq_lens))
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    per_thread = scratch_floats(max(tile_tokens, decode_heads) * group, head_dim, block_size)
    scratch = np.empty(nthreads * per_thread, np.float32)
    counter = np.zeros(1, np.int64)
    params = np.array((query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
                       tables.ctypes.data, tables.shape[1], cu.ctypes.data, seq_lens.ctypes.data,
                       item_seq.ctypes.data, item_t0.ctypes.data, item_h0.ctypes.data, item_seq.shape[0],
                       tile_tokens, decode_heads, num_heads, num_kv_heads, head_dim, block_size,
                       _bits(scale), scratch.ctypes.data, per_thread, counter.ctypes.data, DTYPES[key_cache.dtype],
                       _bits(k_scale), _bits(v_scale), DTYPES[query.dtype]), np.int64)
    return params, (tables, cu, seq_lens, item_seq, item_t0, item_h0, scratch, counter)


def _bits(x: float) -> int:
    """x rounded to fp32, as the bits of a parameter slot."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def run_params(params: np.ndarray, nthreads: int) -> None:
    """Run a block made by `attention_params` (its counter at zero)."""
    if nthreads == 1:
        library().worker(params.ctypes.data, 0)
    else:
        _FAN_OUT[isa()](params, nthreads)
