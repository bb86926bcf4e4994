"""numba, set up once for every compiled CPU kernel of the course
(`cpu_paged_attention`, `cpu_layer_ops`): where its cache lives, how big its
thread pool is, and how its threads wait.

vLLM counterpart: none as such; vLLM's CPU build compiles its C++ kernels
ahead of time and runs them on torch's OpenMP threads
(`vllm/v1/worker/cpu_worker.py` binds them). numba compiles on first use and
brings its own OpenMP runtime, which is what this module deals with.

Threads: as many as torch uses (`torch.set_num_threads`, OMP_NUM_THREADS), so
one setting governs both. numba's OpenMP layer loads the system libgomp,
torch its own copy, so two OpenMP thread teams share the cores. An idle
libgomp thread spins (by default for millions of cycles) before it sleeps, and
a spinning team takes the core the other team's thread needs: with both teams
spinning, 48 requests on 2 threads took 38.4 s instead of 5.4 s. So numba's
team is started passive (`_passive_numba_team`): its threads sleep as soon as
a kernel call ends. torch's team keeps spinning, which its many short ops
need (making it passive too: about 13 s instead of 10 s for 128 requests).

Import this module before `numba` anywhere in the package: numba reads
NUMBA_NUM_THREADS and NUMBA_CACHE_DIR when it is imported.

Compile: once per cache width (float32 for fp32, uint16 for bf16 and fp16)
on first use, about 10 to 11 s of CPU each (the decode path doubled it; the
BLAS bindings add about 1 s), then loaded from numba's on-disk cache in
under half a second (`cache=True`: `__pycache__` beside this file, or
NUMBA_CACHE_DIR where that is read-only; `benchmarks/bench_engine_attention.py`
prints both).
"""
from __future__ import annotations

import os
import tempfile

import torch  # noqa: F401  (torch's OpenMP runtime is loaded first, see _passive_numba_team)


def _writable_cache_dir() -> None:
    """numba caches beside the source; where that is read-only (an installed
    package) and no NUMBA_CACHE_DIR is set, use a per-user temp folder rather
    than fail at import."""
    here = os.path.dirname(os.path.abspath(__file__))
    if "NUMBA_CACHE_DIR" not in os.environ and not os.access(here, os.W_OK):
        os.environ["NUMBA_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"mini_vllm_numba_{os.getuid()}")


def _thread_pool_size() -> None:
    """numba sizes its thread pool once, at import, from the CPUs this process
    may use at that moment. A process that is pinned to one core when the
    kernel is first imported and widened later (a benchmark's 1-thread phase,
    then its 2-thread phase) would keep a 1-thread pool for good. So the pool
    gets every CPU of the machine; each call still uses only as many threads
    as torch does."""
    if "NUMBA_NUM_THREADS" not in os.environ:
        os.environ["NUMBA_NUM_THREADS"] = str(os.cpu_count() or 1)


def _passive_numba_team() -> None:
    """Start numba's thread pool now, with its OpenMP runtime told to put idle
    threads to sleep at once (see "Threads" above). libgomp reads
    OMP_WAIT_POLICY once, when it is loaded: torch's copy was loaded with torch
    (imported above) and is not affected; the variable is removed again, so
    child processes (the multiprocess executor's workers) do not inherit it. A
    policy the user set is left alone."""
    if "OMP_WAIT_POLICY" in os.environ:
        numba_parallel._launch_threads()
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        numba_parallel._launch_threads()
    finally:
        del os.environ["OMP_WAIT_POLICY"]


_writable_cache_dir()
_thread_pool_size()

import numba  # noqa: E402  (after the cache dir and pool size are settled: numba reads them at import)
from numba.np.ufunc import parallel as numba_parallel  # noqa: E402

_passive_numba_team()

__all__ = ["numba"]
