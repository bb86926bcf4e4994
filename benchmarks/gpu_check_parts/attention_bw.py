"""Decode attention alone: bytes/s the Triton kernel reaches against the device's peak.

vLLM counterpart: `benchmarks/kernels/benchmark_paged_attention.py`.

Qwen3-0.6B's attention (16 query / 8 KV heads of 128; `--small`: 4 / 2 of 16),
bf16, block size 16,
for every batch size x context length of the plan, through shuffled block
tables. Three launches: `decode` (one program per sequence and KV head),
`varlen` with one query per sequence (what a mixed step launches), and
`engine`, what the engine's Triton backend launches for a pure-decode step:
the split-KV kernel (`paged_attention_split.py`) when batch x KV heads cannot
fill the SMs, else `decode` (the goals are judged on `engine`). The argument checks
(host reads) run once per shape, then the kernel alone is timed with CUDA
events around `iters` back-to-back launches.

Bytes per call: the K and V of every cached position, the queries, the output
and the block tables. Peak: the device's published HBM bandwidth when its
name is in PEAK_BYTES_PER_S, and always a measured device-to-device copy.
"""
from __future__ import annotations

import time

import torch

from gpu_check_parts.plan import Plan

# Published memory bandwidth, bytes/s, by a substring of torch's device name (first match wins).
PEAK_BYTES_PER_S = [("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                    ("A100 80GB PCIe", 1.935e12), ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12),
                    ("L40S", 0.864e12), ("L4", 0.3e12), ("A10G", 0.6e12), ("RTX 4090", 1.008e12)]


def published_peak(name: str) -> float | None:
    return next((bw for key, bw in PEAK_BYTES_PER_S if key in name), None)


def _time(fn, iters: int, device: str) -> float:
    """Seconds per call, averaged over `iters` back-to-back calls after one warm-up."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def copy_bandwidth(device: str, small: bool) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    n = (16 << 20) if small else (2 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sec = _time(lambda: dst.copy_(src), 3 if small else 10, device)
    return 2 * n / sec


def decode_case(batch: int, context: int, block_size: int, heads, device: str, gen: torch.Generator):
    H, KVH, D = heads
    blocks = -(-context // block_size)
    num_blocks = batch * blocks + 1
    # drawn on the device in bf16: the largest case is 8.6 GB of K/V, minutes to draw on the host
    kc = torch.randn(num_blocks, block_size, KVH, D, device=device, dtype=torch.bfloat16)
    vc = torch.randn(num_blocks, block_size, KVH, D, device=device, dtype=torch.bfloat16)
    table = torch.randperm(num_blocks, generator=gen)[:batch * blocks].view(batch, blocks).to(device, torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, H, D, device=device, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q, kc, vc, table, seq_lens, cu


def bytes_moved(batch: int, context: int, block_size: int, heads) -> int:
    H, KVH, D = heads
    kv = 2 * batch * context * KVH * D * 2           # K and V, bf16
    qo = 2 * batch * H * D * 2                       # queries in, output out
    return kv + qo + batch * -(-context // block_size) * 4 + batch * 4


def run(plan: Plan, device_name: str) -> dict:
    from mini_vllm.kernels import paged_attention as pa
    from mini_vllm.kernels import paged_attention_split as split

    dev, gen = plan.device, torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    peak = published_peak(device_name) if dev == "cuda" else None
    copy = copy_bandwidth(dev, plan.small)
    rows = []
    for b in plan.attn_batches:
        for ctx in plan.attn_contexts:
            q, kc, vc, table, seq_lens, cu = decode_case(b, ctx, plan.block_size, plan.attn_heads, dev, gen)
            scale = plan.attn_heads[2] ** -0.5
            # checked once (and compared), then the bare launches are timed
            a = pa.paged_attention_decode(q, kc, vc, table, seq_lens, scale)
            v = pa.paged_attention_varlen(q, kc, vc, table, cu, seq_lens, scale)
            agree = (a.float() - v.float()).abs().max().item()
            row = {"batch": b, "context": ctx, "bytes": bytes_moved(b, ctx, plan.block_size, plan.attn_heads),
                   "decode_vs_varlen_max_diff": agree}
            # What the engine's Triton backend launches for a pure-decode step of this batch:
            # the split-KV kernel when the batch cannot fill the device, else the decode kernel.
            segments = split.num_segments_for(b, plan.attn_heads[1], split.device_parallelism(q.device))
            e = split.paged_attention_decode_split(q, kc, vc, table, seq_lens, scale, num_segments=segments)
            row["engine_vs_decode_max_diff"] = (e.float() - a.float()).abs().max().item()
            row["segments"] = segments
            ws = split.SplitKVWorkspace.allocate(b, plan.attn_heads[0], plan.attn_heads[2], segments, q.device)
            launches = {"decode": lambda: pa._launch(q, kc, vc, table, seq_lens, None, scale, decode=True),
                        "varlen": lambda: pa._launch(q, kc, vc, table, seq_lens, cu, scale, decode=False),
                        "engine": (lambda: split.split_kv_launch(q, kc, vc, table, seq_lens, scale, segments, ws))
                        if segments > 1 else (lambda: pa._launch(q, kc, vc, table, seq_lens, None, scale, decode=True))}
            for kind, launch in launches.items():
                sec = _time(launch, plan.attn_iters, dev)
                bw = row["bytes"] / sec
                row[kind] = {"us": sec * 1e6, "bytes_per_s": bw, "fraction_of_peak": bw / peak if peak else None,
                             "fraction_of_copy": bw / copy}
            rows.append(row)
            del q, kc, vc, table
    gb, gc = plan.attn_goal_shape
    at_goal = next(r for r in rows if r["batch"] == gb and r["context"] == gc)
    h, kvh, d = plan.attn_heads
    return {"heads": {"query": h, "kv": kvh, "head_dim": d}, "dtype": "bfloat16", "block_size": plan.block_size,
            "published_peak_bytes_per_s": peak, "copy_bytes_per_s": copy, "rows": rows,
            "goal_shape": {"batch": gb, "context": gc}, "at_goal_shape": at_goal}
