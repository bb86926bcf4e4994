"""The CPU kernels built and run as on a CPU without AVX-512.

Run by tests/test_kernels_cpu_attention.py in a fresh process whose environment
is `mini_vllm.kernels.cpu_runtime.AVX2_ONLY_ENV` plus an empty NUMBA_CACHE_DIR
(numba's machine-code inspection works only for code compiled in this process).
Every numba function the engine calls is compiled for Haswell, run on a few
batches and compared with torch: the paged-attention kernel (fp32, bf16 and fp16
caches; the decode path, the tiled path, a mixed batch) against Chapter 1's
reference, and the fused layer ops (fp32 and bf16) against their torch formulas.
Then its machine code is scanned for any AVX-512 instruction. The same cases run
again through the C++ kernels, which such a CPU runs in their AVX2 build
(kernels/cpu_native.py; test_kernels_cpu_dispatch.py scans that build's code).

No arguments. Prints one JSON object: numba's target CPU and feature string,
per case the largest difference from torch, per compiled function the count of
256-bit registers used and of AVX-512 marks (zmm registers, mask registers k1-k7,
ymm/xmm 16-31, embedded broadcasts), and the functions that compiled to nothing
to scan.
"""
import json
import os
import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent  # kernel_cases and strategies live there (also in a mutant's copy)

AVX512_MARKS = re.compile(r"%zmm\d+|%k[1-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b|\{1to\d+\}")


def attention_cases(torch, cpa, ref) -> dict:
    """name -> largest |kernel - reference| over a batch, in the kernel tests' NaN-filled
    caches (a read past seq_len shows as NaN)."""
    from kernel_cases import build_cache, scrambled_layout
    from strategies import GQAShape, RaggedBatch

    out = {}
    # (query heads, KV heads, head_dim, q_lens, seq_lens): decode path (group 2, 4),
    # tiled decodes (group 16 > DECODE_MAX_GROUP), a prefill chunk with decodes
    shapes = {"decode g2 d64": (4, 2, 64, [1] * 6, [17, 40, 64, 100, 5, 33]),
              "decode g4 d128": (16, 4, 128, [1] * 3, [70, 31, 128]),
              "decode g16 d64 (tiled)": (32, 2, 64, [1] * 2, [50, 90]),
              "mixed chunk + decodes": (8, 2, 64, [37, 1, 1, 20], [60, 45, 12, 20])}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for seed, (name, (heads, kv_heads, d, q_lens, seq_lens)) in enumerate(shapes.items()):
            batch, shape = RaggedBatch(tuple(seq_lens), tuple(q_lens)), GQAShape(heads, kv_heads, d)
            k_cache, v_cache, tables, lens, _, _, qs = build_cache(
                batch, scrambled_layout(seq_lens, 16, seed), shape, dtype, seed)
            cu, query = torch.tensor(batch.cu_seqlens_q, dtype=torch.int32), torch.cat(qs)
            got = cpa.paged_attention_varlen(query, k_cache, v_cache, tables, cu, lens, d ** -0.5)
            want = ref.paged_attention_varlen(query, k_cache, v_cache, tables, cu, lens, d ** -0.5)
            out[f"attention {name} {str(dtype)[6:]}"] = (got.float() - want.float()).abs().max().item()
    return out


def layer_op_cases(torch, ops) -> dict:
    """name -> largest |op - torch| relative to the output's scale."""
    out = {}
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 96, generator=g).to(dtype)
        res = torch.randn(7, 96, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)

        def norm(t):
            t = t.float()
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()

        gate_up = torch.randn(5, 2 * 48, generator=g).to(dtype)
        positions = torch.tensor([0, 3, 9, 1, 30, 2, 7])
        inv = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
        angles = torch.arange(64).float()[:, None] * inv[None]
        cos, sin = angles.cos(), angles.sin()
        heads = torch.randn(7, 3 * 32, generator=g).to(dtype)
        h = heads.float().view(7, 3, 32)
        c, s = cos[positions][:, None], sin[positions][:, None]
        x1, x2 = h[..., :16], h[..., 16:]
        rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).view(7, 96)
        fused_out, fused_res = ops.fused_add_rms_norm(x, res, w, 1e-6)
        # Qwen3's q/k norms + rotation on heads read as qkv (1 query, 1 KV head): heads 0 and 1
        wq, wk = (1 + 0.1 * torch.randn(32, generator=g)).to(dtype), (1 + 0.1 * torch.randn(32, generator=g)).to(dtype)
        normed = torch.stack([hh * torch.rsqrt(hh.pow(2).mean(-1, keepdim=True) + 1e-6) * ww.float()
                              for hh, ww in ((h[:, 0], wq), (h[:, 1], wk))], 1)
        n1, n2 = normed[..., :16], normed[..., 16:]
        qk_want = torch.cat([n1 * c - n2 * s, n2 * c + n1 * s], -1)
        qk_q, qk_k = ops.qk_norm_rope(positions, heads, 1, 1, 32, wq, wk, 1e-6, cos, sin)
        pairs = {"rms_norm": (ops.rms_norm(x, w, 1e-6), norm(x)),
                 "fused_add_rms_norm": (fused_out, norm(x.float() + res.float())),
                 "fused_add_rms_norm residual": (fused_res, x.float() + res.float()),
                 "silu_and_mul": (ops.silu_and_mul(gate_up),
                                  torch.nn.functional.silu(gate_up[:, :48].float()) * gate_up[:, 48:].float()),
                 "rotary_embedding": (ops.rotary_embedding(positions, heads, cos, sin, 32), rotated),
                 "qk_norm_rope q": (qk_q, qk_want[:, 0]), "qk_norm_rope k": (qk_k, qk_want[:, 1])}
        for name, (got, want) in pairs.items():
            err = (got.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            out[f"{name} {str(dtype)[6:]}"] = err
    return out


def scan(functions) -> tuple[dict, list]:
    """Each compiled overload's machine code: 256-bit registers used, AVX-512 marks."""
    found, empty = {}, []
    for name, fn in functions.items():
        listings = fn.inspect_asm() if fn.signatures else {}
        if not listings:
            empty.append(name)
        for i, asm in enumerate(listings.values()):
            found[f"{name}#{i}"] = {"ymm": len(re.findall(r"%ymm\d+", asm)),
                                    "avx512": len(AVX512_MARKS.findall(asm))}
    return found, empty


def main() -> None:
    if not os.environ.get("NUMBA_CPU_NAME") or not os.environ.get("NUMBA_CACHE_DIR"):
        sys.exit("run with cpu_runtime.AVX2_ONLY_ENV and an empty NUMBA_CACHE_DIR (see the docstring)")
    sys.path.insert(0, str(TESTS))
    import torch
    from numba.core.registry import cpu_target

    from mini_vllm import paged_attention as ref
    from mini_vllm.kernels import cpu_layer_ops as ops, cpu_layer_ops_bf16 as ops_bf16
    from mini_vllm.kernels import cpu_native, cpu_paged_attention as cpa

    torch.set_num_threads(2)  # the parallel loops with more than one thread
    with cpu_native.numba_only():  # the numba loops, which the C++ kernels would replace
        errors = {**attention_cases(torch, cpa, ref), **layer_op_cases(torch, ops)}
    native = {**attention_cases(torch, cpa, ref), **layer_op_cases(torch, ops)}  # the C++ build numba's target allows
    codegen = cpu_target.target_context.codegen()
    functions = {"_varlen_kernel": cpa._varlen_kernel, "_decode_item": cpa._decode_item,
                 "_attend_item": cpa._attend_item, "_rms_norm_rows": ops._rms_norm_rows,
                 "_add_rms_norm_rows": ops._add_rms_norm_rows, "_silu_and_mul_rows": ops._silu_and_mul_rows,
                 "_rope_rows": ops._rope_rows, "rms_norm_rows_bf16": ops_bf16.rms_norm_rows_bf16,
                 "add_rms_norm_rows_bf16": ops_bf16.add_rms_norm_rows_bf16,
                 "silu_and_mul_rows_bf16": ops_bf16.silu_and_mul_rows_bf16, "rope_rows_bf16": ops_bf16.rope_rows_bf16,
                 "_qk_norm_rope_rows": ops._qk_norm_rope_rows, "_norm_head": ops._norm_head,
                 "qk_norm_rope_rows_bf16": ops_bf16.qk_norm_rope_rows_bf16, "_norm_head_bf16": ops_bf16._norm_head_bf16}
    code, empty = scan(functions)
    print(json.dumps({"cpu": codegen._get_host_cpu_name(), "features": codegen._get_host_cpu_features(),
                      "errors": errors, "code": code, "not_compiled": empty,
                      "native": cpu_native.unavailable_reason(), "native_isa": cpu_native.isa(),
                      "native_loaded": cpu_native.library() is not None, "native_errors": native}))


if __name__ == "__main__":
    main()
