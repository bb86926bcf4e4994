"""The machine a benchmark ran on, in one line: every ratio printed beside it holds
for that CPU only (a wider core rewards vLLM's hand-vectorised C++ more than
numba's loops; AVX-512 BF16 or AMX change what bf16 linears cost).

vLLM counterpart: `vllm collect-env` (`vllm/collect_env.py`) prints the CPU and
its flags for bug reports; this is the part a speed ratio needs, plus a
measured memory bandwidth, since decode attention is bound by it.

- `parse_cpuinfo(text)`: model name, vendor, family / model numbers and the ISA
  flags that matter here (AVX2, AVX-512F, AVX512_BF16, AMX) from
  /proc/cpuinfo's first processor block;
- `read_bandwidth(threads)`: a STREAM-like read probe, GB/s: the best of a few
  `torch.sum` passes over 256 MiB of fp32 (sum reads each byte once and writes
  nothing, so it is bound by reading, as decode attention is), on 2 MiB pages
  where the OS allows, as the engine's KV cache is (`worker/host_memory.py`).
  On 4 KiB pages every 4 KiB read also walks the page table: the Zen 4 test
  machine read 20-24 GB/s that way, 26-30 GB/s on 2 MiB pages;
- `machine_line(threads)`: both, as the line the benchmarks print first.
"""
from __future__ import annotations

import os
import platform
import time

# /proc/cpuinfo flag -> the name printed (the ones that change which code is fastest here)
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512F", "avx512_bf16": "AVX512_BF16", "amx_bf16": "AMX-BF16"}
PROBE_BYTES = 256 << 20  # well past any L3 of a 2-core slice, so the probe reads memory


def parse_cpuinfo(text: str) -> dict:
    """The first processor block of /proc/cpuinfo: {"model_name", "vendor", "family",
    "model", "isa"} (isa: the ISA_FLAGS names present, in ISA_FLAGS order)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first block is enough: every core of a VM reports the same
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"model_name": fields.get("model name", platform.processor() or "unknown CPU"),
            "vendor": fields.get("vendor_id", "unknown"),
            "family": fields.get("cpu family", "?"), "model": fields.get("model", "?"),
            "isa": [name for flag, name in ISA_FLAGS.items() if flag in flags]}


def cpu_info() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:  # not Linux: the name only
        return parse_cpuinfo("")


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """GB/s read by `threads` threads: the best of `repeats` sums of PROBE_BYTES of fp32."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        try:
            from mini_vllm.worker.host_memory import hugepage_zeros
            x = hugepage_zeros((PROBE_BYTES // 4,), torch.float32).fill_(1.0)
        except ImportError:  # run outside the project's environment
            x = torch.ones(PROBE_BYTES // 4)
        x.sum()  # first touch: page faults are not bandwidth
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return PROBE_BYTES / best / 1e9
    finally:
        torch.set_num_threads(before)


def machine_line(threads: list[int] | tuple[int, ...] = (1,)) -> str:
    """One line: CPU, family/model, usable cores, ISA flags, read bandwidth per thread count."""
    info = cpu_info()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    bw = ", ".join(f"{read_bandwidth(t):.1f} GB/s with {t} thread{'s' if t > 1 else ''}" for t in threads)
    return (f"machine: {info['model_name']} ({info['vendor']}, family {info['family']} model {info['model']}), "
            f"{cores} cores usable, ISA: {' '.join(info['isa']) or 'none of ' + '/'.join(ISA_FLAGS.values())}; "
            f"read bandwidth {bw}")


if __name__ == "__main__":
    print(machine_line((1, 2) if (os.cpu_count() or 1) > 1 else (1,)))
