"""Host memory for the CPU KV cache, backed by 2 MiB pages where the OS allows.

vLLM counterpart: none in Python; vLLM's CPU worker leaves this to the
allocator it preloads (`vllm/platforms/cpu.py` puts tcmalloc in LD_PRELOAD).

Why: attention reads the cache block by block, and a request's blocks lie
anywhere in a cache of hundreds of MiB. With 4 KiB pages nearly every block
read misses the TLB (its 2,048 entries map 8 MiB) and waits for a page walk;
a 2 MiB page covers 32-128 blocks. On the 2-core test machine the engine's
attention took 4-6% less time on the tiny fp32 workload (256 requests, one
thread) with the cache on 2 MiB pages.

Invariants:
* `hugepage_zeros(shape, dtype)` is zero-filled, contiguous, writable and
  owns its memory like any tensor (the mapping lives as long as the tensor);
* the request is advice (`madvise(MADV_HUGEPAGE)`): where transparent huge
  pages are off, or the Python has no MADV_HUGEPAGE (not Linux), the memory is
  ordinary pages and everything else is the same;
* every page is touched here, as `torch.zeros` would: left to its first touch,
  a 2 MiB page is zeroed (and, with THP's default `defrag=madvise`, possibly
  compacted for) inside an engine step. Lazily touched, the first timed run of
  the tiny workload took 24.9 s against 21.6-22.9 s for the others.
"""
from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def hugepage_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose memory is asked to be backed by 2 MiB pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # Private: a shared anonymous mapping is shmem, which THP leaves alone by default.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # + room to align
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE_PAGE
    buf.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds a reference to the mapping, which closes when the tensor is freed.
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
    return t.zero_()  # touched now: a page first touched inside a step would stall that step
