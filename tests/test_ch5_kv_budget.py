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
