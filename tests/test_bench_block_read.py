"""The ceiling `bench_engine_attention.py` prints beside the decode kernel: a plain read
of the same blocks (`benchmarks/csrc/block_read.cpp`). It is only a ceiling if it reads
exactly what the kernel reads: every readable slot of every block of every sequence,
nothing past a sequence's last key, in the kernel's order."""
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_engine_attention as bench  # noqa: E402
from mini_vllm.kernels import cpu_native  # noqa: E402
from mini_vllm.kernels.cpu_paged_attention import plan_items  # noqa: E402


def _case(block_size=16, seq_lens=(5, 40, 17, 16)):
    return bench.make((4, 2, 64), list(seq_lens), [1] * len(seq_lens), torch.float32, block_size)


def test_spans_cover_each_readable_slot_once_in_plan_order():
    q, kc, _, md, kv_bytes, _ = _case()
    spans = bench.block_spans(q, kc, md, threads=1)
    slot_bytes = kc.shape[2] * kc.shape[3] * kc.element_size()
    block_bytes = kc.shape[1] * slot_bytes
    assert 2 * int(spans[:, 1].sum()) == kv_bytes, \
        "the spans do not add up to the batch's K/V bytes: a partial last block read whole, or a block missed"
    order, _, _, _ = plan_items(md.cu_seqlens_q.numpy(), md.seq_lens.numpy(), 16, 2, 2, 1)
    want = []
    for i in order:
        n = int(md.seq_lens[i])
        want += [int(md.block_tables[i, b]) * block_bytes for b in range(-(-n // kc.shape[1]))]
    assert spans[:, 0].tolist() == want, "the spans are not the plan's sequences' blocks, in the plan's order"


def test_spans_only_for_all_decode_batches():
    q, kc, _, md, _, _ = bench.make((4, 2, 64), [40, 20], [8, 1], torch.float32)
    assert bench.block_spans(q, kc, md, threads=1) is None, \
        "a batch with a prefill has no single-run blocks: the probe must not claim a ceiling for it"


@pytest.mark.skipif(shutil.which(cpu_native._compiler()) is None, reason="no C++ compiler")
def test_probe_reads_exactly_the_spans():
    probe = bench.block_read_library()
    if probe is None:
        pytest.skip("the probe did not build here")
    q, kc, vc, md, _, _ = _case()
    spans = bench.block_spans(q, kc, md, threads=1)
    got = probe.mini_vllm_block_read(kc.data_ptr(), vc.data_ptr(), spans.ctypes.data, len(spans))
    words_k = kc.view(torch.uint8).numpy().reshape(-1)
    words_v = vc.view(torch.uint8).numpy().reshape(-1)
    want = 0
    for at, n in spans:
        for buf in (words_k, words_v):
            want += int(buf[at:at + n].view(np.uint64).astype(object).sum())
    assert got == want % (1 << 64), "the probe read other bytes than the spans name (offsets or lengths wrong)"
