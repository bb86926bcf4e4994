"""numba's runtime for the CPU kernels: cache folder, thread pool, BLAS threads.

vLLM counterpart: the thread binding in `vllm/v1/worker/cpu_worker.py` and
`csrc/cpu/utils.cpp` (`init_cpu_threads_env`), which vLLM's C++ kernels need
because they run on OpenMP threads of their own.

The compiled loops live in `cpu_paged_attention.py` and `cpu_layer_ops.py`;
this module is the plumbing they share, kept apart so that those files hold
only what numba compiles (and caches by file). Importing it changes no
environment variable and starts no thread: numba's configuration is set on
`numba.config` before anything compiles, and the thread team starts on the
first kernel call (`use_torch_threads`).

Threads: as many as torch uses (`torch.set_num_threads`, OMP_NUM_THREADS), so
one setting governs both. numba runs a parallel loop on an OpenMP thread team.
torch is imported first (below), and it loads its own libgomp into the
process's global symbol scope, so numba's OpenMP layer binds to that copy:
torch's ops, oneDNN's linears and the kernels share one team, whose idle
threads spin for a moment between calls, so each call starts without waking
a thread. Where numba's pool was started before torch was ever imported, it
binds the system's libgomp instead, a second team on the same cores; an idle
libgomp thread spins (by default for millions of cycles) before it sleeps,
and a spinning team holds the cores the other team's threads need. That team
is therefore started passive (`_start_thread_team`): its threads sleep as
soon as a call ends.

BLAS is held to one thread while a kernel that calls it runs
(`single_threaded_blas`): numba's threads are the parallelism, and an
OpenBLAS that split each product again would put 2 x 2 threads on 2 cores.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading

import torch  # before numba: its libgomp must be the one numba's OpenMP layer binds (see "Threads")
import numba  # noqa: E402
import scipy.linalg.cython_blas  # noqa: E402, F401  (the BLAS numba's np.dot calls: loaded before we limit it)
from numba.np.ufunc import parallel as numba_parallel  # noqa: E402


def _configure_numba() -> None:
    """Two settings numba reads from its config object, set there (not in the
    environment, which child processes would inherit):

    - the cache folder: numba caches beside the source; where that is
      read-only (an installed package) and no NUMBA_CACHE_DIR is set, a
      per-user temp folder rather than a failure at the first compile;
    - the pool size: numba sizes its pool from the CPUs the process may use
      when numba is imported. A process pinned to one core then and widened
      later (a benchmark's 1-thread phase, then its 2-thread phase) would keep
      a 1-thread pool for good, so the pool gets every CPU of the machine; each
      call still uses only as many threads as torch does. Left alone when the
      user set NUMBA_NUM_THREADS or the pool already runs (its size is fixed).

    numba re-reads its environment before each compile but applies it only
    when a NUMBA_* variable changed, so these settings hold. numba has no
    public setter for the pool size: `gen_snt_check`, `_is_initialized` and
    `_launch_threads` are its internals, pinned by the fresh-process tests in
    `tests/test_kernels_cpu_attention.py` (a numba that renames them fails
    there, not silently)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if "NUMBA_CACHE_DIR" not in os.environ and not os.access(here, os.W_OK):
        numba.config.CACHE_DIR = os.path.join(tempfile.gettempdir(), f"mini_vllm_numba_{os.getuid()}")
    if "NUMBA_NUM_THREADS" not in os.environ and not numba_parallel._is_initialized:
        numba.config.NUMBA_NUM_THREADS = max(numba.config.NUMBA_NUM_THREADS, os.cpu_count() or 1)
        # numba.set_num_threads checks its argument against a bound it captured when
        # numba.np.ufunc.parallel was imported: rebuilt from the new size.
        numba_parallel.snt_check = numba_parallel.gen_snt_check()


_configure_numba()

_team_lock = threading.Lock()
_team_started = False


def _start_thread_team() -> None:
    """Start numba's thread pool, with its OpenMP runtime told to put idle
    threads to sleep at once (see "Threads"). libgomp reads OMP_WAIT_POLICY
    once, when it is loaded: torch's copy was loaded with torch and is not
    affected; the variable is removed again right after, so child processes
    (the multiprocess executor's workers) do not inherit it. A policy the user
    set is left alone."""
    global _team_started
    with _team_lock:
        if _team_started:
            return
        ours = "OMP_WAIT_POLICY" not in os.environ
        if ours:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        torch_threads = torch.get_num_threads()
        try:
            numba_parallel._launch_threads()
        finally:
            if ours:
                del os.environ["OMP_WAIT_POLICY"]
            # Where numba's OpenMP layer is torch's libgomp, starting its pool sets this
            # thread's OpenMP thread count to the pool's size (every core): a process
            # started with OMP_NUM_THREADS=1 would run every later torch op on all cores.
            if torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)
        _team_started = True


_numba_threads = threading.local()  # the count use_torch_threads last gave numba, per calling thread


def use_torch_threads(cap: int | None = None) -> int:
    """Set numba's thread count for this thread's next parallel calls to torch's
    (at most numba's pool, and at most `cap`), and return it; the first call
    starts the pool. numba's setter is called only when the count changes
    (numba keeps it per calling thread, and so does this): it costs about 1 us,
    against the 4 us a small layer op takes, and the engine makes about 40
    compiled calls per step."""
    if not _team_started:
        _start_thread_team()
    torch_threads = torch.get_num_threads()
    nthreads = max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS, cap or torch_threads))
    if getattr(_numba_threads, "n", None) != nthreads:
        numba.set_num_threads(nthreads)
        _numba_threads.n = nthreads
    return nthreads


_blas_libraries = None  # threadpoolctl's handles on the process's BLAS libraries, found on first use


@contextlib.contextmanager
def single_threaded_blas():
    """BLAS held to one thread inside the block, then set back. numba's np.dot
    calls scipy's OpenBLAS from inside the prange threads, and OpenBLAS splits
    any product above 64 x 64 x 64 multiply-adds over threads of its own, as
    many as there are cores unless OPENBLAS_NUM_THREADS / OMP_NUM_THREADS say
    otherwise: 2 numba threads x 2 BLAS threads on 2 cores. Measured on one
    core with 2 BLAS threads: a 64 x 64 x 128 product took 15.6 ms instead of
    12.8 us, a 512-token prefill 11.8 s instead of 20 ms (the threads spin,
    waiting for each other). threadpoolctl (installed with scikit-learn, which
    lm-eval needs) finds every loaded BLAS whatever its build; without it BLAS
    is left as configured. Costs 2 us a call (11 us when it has to change and
    restore a thread count), against the call's fixed 50 us."""
    global _blas_libraries
    if _blas_libraries is None:
        try:
            from threadpoolctl import ThreadpoolController
            _blas_libraries = ThreadpoolController().select(user_api="blas").lib_controllers
        except ImportError:
            _blas_libraries = []
    changed = []
    for lib in _blas_libraries:
        threads = lib.get_num_threads()
        if threads is not None and threads > 1:
            lib.set_num_threads(1)
            changed.append((lib, threads))
    try:
        yield
    finally:
        for lib, threads in changed:
            lib.set_num_threads(threads)


# The environment under which this machine runs the kernels as a CPU without
# AVX-512 would (an AVX2 + FMA x86 core, Intel Haswell or later, AMD Zen 1-3):
# numba's LLVM targets Haswell with that model's own feature set (an empty
# feature string means "the named CPU's defaults", so no AVX-512 instruction
# can be emitted); torch's kernels, oneDNN (whose bf16 packing then reports
# itself unsupported), MKL and OpenBLAS (the tiled path's np.dot) are held to
# AVX2 too, and the C++ kernels run their AVX2 build (cpu_native.isa()), as on
# such a CPU: bf16 linears take its kernel. Set in a fresh process before
# anything is imported: each library reads it once. Used by
# tests/programs/avx2_kernels.py and `bench_engine_attention.py --isa avx2`.
# numba's disk cache keys machine code on the target CPU, so this build never
# replaces the native one.
AVX2_ONLY_ENV = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "", "ATEN_CPU_CAPABILITY": "avx2",
                 "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OPENBLAS_CORETYPE": "Haswell"}
