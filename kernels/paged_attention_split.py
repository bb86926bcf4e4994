"""Split-KV decode attention in Triton (FlashDecoding): a sequence's keys split into segments.

vLLM counterpart: the segmented ("3-D") path of the unified Triton kernel,
`kernel_unified_attention_3d` and `reduce_segments` in
`vllm/attention/ops/triton_unified_attention.py`, which vLLM launches for
decode batches too small to fill the GPU; FlashDecoding (Dao et al., 2023) is
the same idea.

Why: the plain decode kernel (`paged_attention.py`) runs one program per
(sequence, KV head). At batch 1 with 8 KV heads that is 8 programs, while an
H100 has 132 SMs: 124 of them idle, and each busy one walks 2,048 keys alone.
Splitting the key range of each (sequence, KV head) into S segments gives
S times as many programs, each reading 1/S of the keys; a second, tiny kernel
combines them.

Kernel 1, grid (num_seqs, num_kv_heads, S): program (b, h, s) runs the online
softmax over its segment of the keys for the GROUP query heads of KV head h
(they fill the M rows of one `tl.dot`, so the group shares every K/V load)
and writes, per query head, the segment's running max m_s (log2 domain), sum
l_s = sum(exp2(x - m_s)) and *unnormalised* output o_s = sum(exp2(x - m_s) v).
The walk over the keys is `paged_attention._attend_key_range`, the same one the
paged kernel runs over a whole sequence.

Kernel 2, grid (num_seqs, num_heads): with M = max over used segments of m_s,
    out = sum_s exp2(m_s - M) o_s / sum_s exp2(m_s - M) l_s,
which is exactly softmax(x) v over all keys: each segment's terms are rescaled
from its own max to the global one, as the online softmax does tile by tile.

Invariants:
- S is a launch constant (a power of two) chosen from tensor shapes only
  (`num_segments_for`); the segment bounds come from seq_lens on the device
  (`_segment_tiles`, shared by both kernels), so a CUDA graph captured for a
  batch size replays correctly for any lengths: nothing is read back.
- A segment that starts past its sequence's last key ("empty": a short
  sequence in a batch sized for long ones) writes nothing; the reduce reads
  only the used segments, so stale or NaN workspace entries (a replayed
  graph's buffers hold the previous step's values) never contribute.
- Arithmetic as in `paged_attention.py`: fp32 softmax, sums and partials;
  native-dtype dots on a GPU, fp32 under the interpreter (which gets bf16 wrong).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .triton_setup import require_triton_mode

require_triton_mode(__name__)  # before triton is first imported: see triton_setup.py

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .paged_attention import BLOCK_N as _BLOCK_N
from .kv_cache_dtype import is_fp8
from .paged_attention import LOG2E, _attend_key_range, native_dot
from .paged_checks import check_paged_attention_args

# Programs per SM the split aims for, and the most segments a sequence is cut into.
# vLLM launches a fixed 16 segments; more than 32 makes the reduce the larger kernel.
PROGRAMS_PER_SM = 2
MAX_SEGMENTS = 32


def device_parallelism(device: torch.device) -> int:
    """How many programs run at once: the SM count on CUDA; on a CPU (the
    interpreter, or a compiled CPU backend) one per core."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1


def num_segments_for(num_seqs: int, num_kv_heads: int, parallelism: int, max_segments: int = MAX_SEGMENTS) -> int:
    """Segments per (sequence, KV head): 1 (the plain decode kernel) when the
    batch alone gives every SM PROGRAMS_PER_SM programs; else the smallest power
    of two that does, capped at max_segments. A function of shapes only, so a
    CUDA graph's capture size fixes it."""
    programs = max(1, num_seqs * num_kv_heads)
    target = PROGRAMS_PER_SM * parallelism
    s = 1
    while s < max_segments and programs * s < target:
        s *= 2
    return s


@dataclass
class SplitKVWorkspace:
    """The partial results of one launch, fp32: `out` [num_seqs, num_heads, S, head_dim],
    `max` and `sum` [num_seqs, num_heads, S]. Reusable across calls of the same shape
    (a CUDA graph replays into the buffers it captured)."""

    out: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor

    @classmethod
    def allocate(cls, num_seqs: int, num_heads: int, head_dim: int, num_segments: int, device) -> "SplitKVWorkspace":
        kw = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(num_seqs, num_heads, num_segments, head_dim, **kw),
                   torch.empty(num_seqs, num_heads, num_segments, **kw),
                   torch.empty(num_seqs, num_heads, num_segments, **kw))

    def fits(self, num_seqs: int, num_heads: int, head_dim: int, num_segments: int, device) -> bool:
        return (tuple(self.out.shape) == (num_seqs, num_heads, num_segments, head_dim)
                and tuple(self.max.shape) == tuple(self.sum.shape) == (num_seqs, num_heads, num_segments)
                and all(t.dtype == torch.float32 and t.device == torch.device(device) and t.is_contiguous()
                        for t in (self.out, self.max, self.sum)))


@triton.jit
def _segment_tiles(seq_len, BLOCK_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr):
    """(key tiles per segment, segments in use) for a sequence of seq_len keys:
    the tiles spread evenly, every used segment non-empty."""
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_segment = tl.maximum(tl.cdiv(num_tiles, NUM_SEGMENTS), 1)
    return per_segment, tl.cdiv(num_tiles, per_segment)


@triton.jit
def _split_kv_segment_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    qk_scale_log2, k_scale, v_scale,
    q_s0, q_s1, q_s2, kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, vc_s3, bt_s0,
    po_s0, po_s1, po_s2, pm_s0, pm_s1,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SEGMENTS: tl.constexpr, NATIVE_DOT: tl.constexpr,
    FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    per_segment, used = _segment_tiles(seq_len, BLOCK_N, NUM_SEGMENTS)
    if segment < used:  # an empty segment writes nothing: the reduce skips it
        r = tl.arange(0, BLOCK_M)  # row r = query head kv_head * GROUP + r
        row_ok = r < GROUP
        head = kv_head * GROUP + r
        d = tl.arange(0, HEAD_DIM_P)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + seq.to(tl.int64) * q_s0 + head[:, None] * q_s1 + d[None, :] * q_s2,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if not NATIVE_DOT:
            q = q.to(tl.float32)
        kv_start = segment * per_segment * BLOCK_N
        kv_end = tl.minimum(seq_len, kv_start + per_segment * BLOCK_N)
        # A decode query sits at position seq_len - 1: every key below seq_len is visible.
        q_pos = tl.zeros([BLOCK_M], tl.int32) + (seq_len - 1)
        m_i, l_i, acc = _attend_key_range(
            q, q_pos, kv_start, kv_end, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * bt_s0, kv_head,
            qk_scale_log2, k_scale, v_scale, kc_s0, kc_s1, kc_s2, kc_s3, vc_s0, vc_s1, vc_s2, vc_s3,
            BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_P, NATIVE_DOT, FP8)
        base = seq.to(tl.int64) * pm_s0 + head * pm_s1 + segment
        tl.store(part_max_ptr + base, m_i, mask=row_ok)
        tl.store(part_sum_ptr + base, l_i, mask=row_ok)
        tl.store(part_out_ptr + seq.to(tl.int64) * po_s0 + head[:, None] * po_s1 + segment * po_s2 + d[None, :],
                 acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr,
    o_s0, o_s1, o_s2, po_s0, po_s1, po_s2, pm_s0, pm_s1,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    per_segment, used = _segment_tiles(seq_len, BLOCK_N, NUM_SEGMENTS)
    s = tl.arange(0, NUM_SEGMENTS)
    s_ok = s < used
    base = seq.to(tl.int64) * pm_s0 + head * pm_s1 + s
    m = tl.load(part_max_ptr + base, mask=s_ok, other=float("-inf"))
    m_all = tl.max(m, axis=0)
    # Each segment's sums are relative to its own max: rescale them to the global one.
    w = tl.where(s_ok, tl.exp2(m - m_all), 0.0)
    total = tl.sum(tl.load(part_sum_ptr + base, mask=s_ok, other=0.0) * w, axis=0)
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    parts = tl.load(part_out_ptr + seq.to(tl.int64) * po_s0 + head * po_s1 + s[:, None] * po_s2 + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # seq_len 0: zeros
    tl.store(out_ptr + seq.to(tl.int64) * o_s0 + head * o_s1 + d * o_s2, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)


def check_num_segments(num_segments) -> None:
    if (isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1
            or num_segments > 1024 or num_segments & (num_segments - 1)):
        raise ValueError(f"num_segments must be a power of two in [1, 1024], got {num_segments!r}")


def split_kv_launch(query, key_cache, value_cache, block_tables, seq_lens, scale, num_segments: int,
                    workspace: SplitKVWorkspace | None = None, out: torch.Tensor | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Both kernels, no argument checks (the engine validates a step's metadata
    once). `workspace` and `out` may be given to reuse buffers; else allocated.
    An fp8 cache is dequantised on load with k_scale / v_scale."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0:
        return out
    if workspace is None:
        workspace = SplitKVWorkspace.allocate(num_seqs, num_heads, head_dim, num_segments, query.device)
    group = num_heads // num_kv_heads
    block_n = max(_BLOCK_N["decode"], triton.next_power_of_2(block_size))
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    ws = workspace
    _split_kv_segment_kernel[(num_seqs, num_kv_heads, num_segments)](
        query, key_cache, value_cache, block_tables, seq_lens, ws.out, ws.max, ws.sum, float(scale) * LOG2E,
        float(k_scale), float(v_scale),
        *query.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        ws.out.stride(0), ws.out.stride(1), ws.out.stride(2), ws.max.stride(0), ws.max.stride(1),
        GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SEGMENTS=num_segments, NATIVE_DOT=native_dot(query),
        FP8=is_fp8(key_cache.dtype), num_warps=4,
    )
    _split_kv_reduce_kernel[(num_seqs, num_heads)](
        out, ws.out, ws.max, ws.sum, seq_lens, *out.stride(),
        ws.out.stride(0), ws.out.stride(1), ws.out.stride(2), ws.max.stride(0), ws.max.stride(1),
        BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SEGMENTS=num_segments, num_warps=1,
    )
    return out


def paged_attention_decode_split(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                 num_segments: int | None = None, workspace: SplitKVWorkspace | None = None,
                                 k_scale=1.0, v_scale=1.0):
    """`paged_attention_decode` with each sequence's keys split into `num_segments`
    segments (default: `num_segments_for` this batch on this device). Same
    arguments, errors and result; `workspace`, if given, must fit the launch."""
    num_seqs = query.shape[0] if isinstance(query, torch.Tensor) and query.dim() == 3 else -1
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, num_seqs,
                               k_scale, v_scale)
    if num_segments is None:
        num_segments = num_segments_for(num_seqs, key_cache.shape[2], device_parallelism(query.device))
    check_num_segments(num_segments)
    if workspace is not None and not workspace.fits(num_seqs, query.shape[1], query.shape[2], num_segments,
                                                   query.device):
        raise ValueError(f"workspace must hold fp32 contiguous partials of shape ({num_seqs}, {query.shape[1]}, "
                         f"{num_segments}, {query.shape[2]}) on {query.device}, got {tuple(workspace.out.shape)}")
    return split_kv_launch(query, key_cache, value_cache, block_tables, seq_lens, scale, num_segments, workspace,
                           k_scale=float(k_scale), v_scale=float(v_scale))
