"""How the CPU kernels' numba pool and torch's thread count get along, in a fresh process.

Run by tests/test_kernels_cpu_attention.py: numba starts its thread pool once
per process, so each case needs an interpreter where nothing was imported yet.
Every case calls a small paged-attention decode (`tiny_decode`) and prints the
thread counts it observed, as words on one line.

argv: CASE [ARG]
  import-side-effects    imports the CPU kernel modules: prints the environment variables that changed
                         and whether numba's thread pool started
  torch-threads-kept     torch set to 1 thread, then the kernel: prints torch's count
  omp-threads-kept       no set_num_threads (OMP_NUM_THREADS from the environment), a layer op,
                         then the kernel: prints torch's count after import, op and kernel
  widened-after-import   kernel imported pinned to one core, then widened to every core and
                         torch at 2: prints the thread count the kernel last gave numba
  imported-on-one-core MODULE
                         MODULE (numba, or mini_vllm.kernels.cpu_layer_ops) imported pinned to one
                         core before the kernels, then widened: prints numba's pool size
The environment (OMP_NUM_THREADS, NUMBA_NUM_THREADS) is the test's.
"""
import importlib
import os
import sys


def tiny_decode(torch, cpa) -> None:
    kc, vc = torch.randn(4, 16, 2, 32), torch.randn(4, 16, 2, 32)
    cpa.paged_attention_decode(torch.randn(2, 4, 32), kc, vc, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                               torch.tensor([20, 30], dtype=torch.int32), 0.2)


def torch_threads_kept() -> list:
    import torch

    torch.set_num_threads(1)
    from mini_vllm.kernels import cpu_paged_attention as cpa

    tiny_decode(torch, cpa)
    return [torch.get_num_threads()]


def omp_threads_kept() -> list:
    import torch
    from mini_vllm.kernels import cpu_layer_ops as L

    seen = [torch.get_num_threads()]
    L.silu_and_mul(torch.randn(8, 16))
    seen.append(torch.get_num_threads())
    from mini_vllm.kernels import cpu_paged_attention as cpa

    tiny_decode(torch, cpa)
    seen.append(torch.get_num_threads())
    return seen


def widened_after_import() -> list:
    import torch

    os.sched_setaffinity(0, {0})
    from mini_vllm.kernels import cpu_paged_attention as cpa
    import numba

    os.sched_setaffinity(0, set(range(os.cpu_count())))
    torch.set_num_threads(2)
    seen = []
    real = numba.set_num_threads
    numba.set_num_threads = lambda n: (seen.append(n), real(n))[1]  # record what the kernel asks for
    cpa.KERNEL_THREADS = 2
    tiny_decode(torch, cpa)
    return [seen[-1]]


def imported_on_one_core(first: str) -> list:
    import torch

    os.sched_setaffinity(0, {0})
    importlib.import_module(first)
    from mini_vllm.kernels import cpu_layer_ops as L
    from mini_vllm.kernels import cpu_paged_attention as cpa
    import numba

    os.sched_setaffinity(0, set(range(os.cpu_count())))
    torch.set_num_threads(2)
    L.rms_norm(torch.randn(8, 16), torch.ones(16), 1e-6)
    tiny_decode(torch, cpa)
    return [numba.config.NUMBA_NUM_THREADS]


def import_side_effects() -> list:
    import torch  # noqa: F401  (as the engine does: torch before the kernels)
    import mini_vllm.kernels  # noqa: F401  (the package picks Triton's interpreter without CUDA, by design)

    before = dict(os.environ)
    from mini_vllm.kernels import cpu_layer_ops, cpu_paged_attention  # noqa: F401
    from numba.np.ufunc import parallel

    changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
    return ["env-changed:" + (",".join(changed) or "none"), f"pool-started:{parallel._is_initialized}"]


CASES = {"import-side-effects": import_side_effects, "torch-threads-kept": torch_threads_kept, "omp-threads-kept": omp_threads_kept,
         "widened-after-import": widened_after_import, "imported-on-one-core": imported_on_one_core}

if __name__ == "__main__":
    print(*CASES[sys.argv[1]](*sys.argv[2:]))
