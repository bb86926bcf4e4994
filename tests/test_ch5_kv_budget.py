"""Which KV budget the worker applies, on CPU and on CUDA, without a GPU.

vLLM counterpart: `Worker.determine_available_memory` (`vllm/v1/worker/gpu_worker.py`),
where an explicit `kv_cache_memory_bytes` replaces the `gpu_memory_utilization`
profile. The CUDA branch is reached here with a stand-in worker whose profiler
returns a marker count, so the test sees which rule chose the block count.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mini_vllm.worker.cache_engine import CPU_DEFAULT_KV_BYTES
from mini_vllm.distributed import GroupCoordinator
from mini_vllm.worker.worker import Worker

BYTES_PER_BLOCK = 4096
PROFILED = 777  # what the stand-in CUDA profiler answers


def _worker(device: str, **cfg) -> Worker:
    w = Worker.__new__(Worker)  # no model: determine_num_blocks needs only these fields
    fields = dict(num_gpu_blocks_override=None, kv_cache_memory_bytes=None, num_cpu_blocks=0, swap_space=0.0)
    w.config = SimpleNamespace(**{**fields, **cfg})
    w.device, w.bytes_per_block, w.tp_group = torch.device(device), BYTES_PER_BLOCK, GroupCoordinator()
    w._profile_cuda_blocks = lambda num_tokens: PROFILED
    return w


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_explicit_kv_cache_memory_bytes_wins_on_every_device(device):
    n, _ = _worker(device, kv_cache_memory_bytes=100 * BYTES_PER_BLOCK + 5).determine_num_blocks(2048)
    assert n == 100, (f"{device}: kv_cache_memory_bytes was ignored ({n} blocks, want 100): on CUDA an "
                      "explicit byte budget must replace the gpu_memory_utilization profile")


def test_defaults_profile_cuda_and_use_512_mib_on_cpu():
    assert _worker("cuda").determine_num_blocks(2048)[0] == PROFILED, \
        "CUDA without kv_cache_memory_bytes must size the cache by profiling (gpu_memory_utilization)"
    assert _worker("cpu").determine_num_blocks(2048)[0] == CPU_DEFAULT_KV_BYTES // BYTES_PER_BLOCK, \
        "CPU without kv_cache_memory_bytes must use the 512 MiB default"
    n, _ = _worker("cuda", num_gpu_blocks_override=9, kv_cache_memory_bytes=1 << 30).determine_num_blocks(2048)
    assert n == 9, "num_gpu_blocks_override must win over every budget"


def _thp_eligible(address: int) -> bool | None:
    """THPeligible of the mapping holding `address` (/proc/self/smaps), None if not shown."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def test_cpu_kv_cache_is_zeroed_and_asks_for_huge_pages():
    """The CPU cache of every layer: Chapter 1's shape and zeros, a writable tensor of its own,
    in a private mapping advised for 2 MiB pages where the kernel offers them."""
    import mmap
    import os

    from mini_vllm.worker.cache_engine import CacheEngine

    engine = CacheEngine(num_layers=2, num_gpu_blocks=64, num_cpu_blocks=0, block_size=32, num_kv_heads=8,
                         head_dim=128, dtype=torch.bfloat16, device="cpu")
    k0, v0 = engine.gpu_cache[0]
    assert k0.shape == v0.shape == (64, 32, 8, 128) and k0.dtype == torch.bfloat16 and k0.is_contiguous()
    assert all(bool((t == 0).all()) for pair in engine.gpu_cache for t in pair), "the KV cache must start zeroed"
    k0.fill_(1.0)
    assert bool((v0 == 0).all()) and bool((engine.gpu_cache[1][0] == 0).all()), \
        "each layer's key and value caches must be separate memory"
    with pytest.raises(ValueError, match="num_kv_heads must be an int >= 1"):
        CacheEngine(1, 64, 0, 32, 0, 128, torch.bfloat16, "cpu")
    mode = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists(mode) or "[never]" in open(mode).read():
        pytest.skip("no transparent huge pages here: the cache is on ordinary pages")
    assert _thp_eligible(k0.data_ptr()) is True, \
        "the CPU KV cache is not eligible for huge pages: not madvised, or a shared (shmem) mapping"
