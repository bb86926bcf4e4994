"""The Triton kernels compile for a GPU, checked without one.

No vLLM counterpart (vLLM's CI compiles on GPU runners). Every other kernel
test on a CPU runs Triton's interpreter, where the paged-attention kernel casts
16-bit K/V to fp32 before its dots: the branch a GPU runs (native bf16/fp16
tensor-core dots, `NATIVE_DOT`) never executes here. This test calls each
public wrapper on CPU tensors with the interpreter off and a recorder in place
of the kernel, so it captures the exact launch the wrapper makes on a GPU
(arguments, constexprs, warps), then compiles that launch for an H100 (sm_90)
and an A100 (sm_80) with Triton's bundled ptxas. A kernel that does not
compile for the GPU, or a wrapper whose launch disagrees with the kernel's
parameters, fails here instead of in the first minutes of a GPU session.

It runs in a subprocess: TRITON_INTERPRET is read when a kernel is defined,
and tests/conftest.py sets it to 1 for this process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r'''
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mini_vllm.kernels import paged_attention as pa, rejection_sampler as rs, reshape_and_cache as rc

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64"}

class Recorder:  # stands in for `kernel[grid](...)`: keeps the launch instead of running it
    def __init__(self, fn):
        self.fn, self.calls = fn, []
    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))

def arg_type(a):
    if isinstance(a, torch.Tensor):
        return "*" + TYPES[a.dtype]
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i32" if -2**31 <= a < 2**31 else "i64"
    return "fp32"

def compile_launch(rec, arch):
    args, kw = rec.calls[-1]
    kw = dict(kw)
    options = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
    names = rec.fn.arg_names
    missing = [n for n in names[len(args):] if n not in kw]
    if missing or len(args) > len(names):
        raise TypeError(f"launch does not match the kernel's parameters: missing {missing}, {len(args)} positional")
    sig = {n: arg_type(a) for n, a in zip(names, args)}
    sig.update({n: "constexpr" for n in names[len(args):]})
    k = triton.compile(ASTSource(rec.fn, sig, {n: kw[n] for n in names[len(args):]}),
                       target=GPUTarget("cuda", arch, 32), options=options)
    return len(k.asm["cubin"])

def attention(kind, dtype):
    rec = pa._paged_attention_kernel = Recorder(pa._paged_attention_kernel)
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(6, 16, 2, 128, generator=g).to(dtype)
    vc = torch.randn(6, 16, 2, 128, generator=g).to(dtype)
    table = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 20], dtype=torch.int32)
    if kind == "decode":
        q = torch.randn(2, 8, 128, generator=g).to(dtype)
        pa.paged_attention_decode(q, kc, vc, table, seq_lens, 0.1)
    else:
        q = torch.randn(9, 8, 128, generator=g).to(dtype)
        pa.paged_attention_varlen(q, kc, vc, table, torch.tensor([0, 8, 9], dtype=torch.int32), seq_lens, 0.1)
    pa._paged_attention_kernel = rec.fn
    assert rec.calls[-1][1]["NATIVE_DOT"] == (dtype != torch.float32), "the GPU launch must use native 16-bit dots"
    return rec

def reshape(dtype):
    rec = rc._reshape_and_cache_kernel = Recorder(rc._reshape_and_cache_kernel)
    kc, vc = torch.zeros(4, 16, 2, 128, dtype=dtype), torch.zeros(4, 16, 2, 128, dtype=dtype)
    k, v = torch.randn(3, 2, 128).to(dtype), torch.randn(3, 2, 128).to(dtype)
    rc.reshape_and_cache(k, v, kc, vc, torch.tensor([0, 17, -1]))
    rc._reshape_and_cache_kernel = rec.fn
    return rec

def rejection():
    rec = rs._rejection_sample_kernel = Recorder(rs._rejection_sample_kernel)
    vocab = 300
    p = torch.rand(3, vocab).softmax(-1)
    rs.rejection_sample_triton(torch.tensor([1, 2, 3]), torch.tensor([2, 1]), p, p,
                               torch.tensor([4, 5]), torch.tensor([False, True]), torch.rand(3),
                               torch.rand(2, vocab))
    rs._rejection_sample_kernel = rec.fn
    return rec

cases = {
    "varlen bf16 sm_90": lambda: compile_launch(attention("varlen", torch.bfloat16), 90),
    "varlen bf16 sm_80": lambda: compile_launch(attention("varlen", torch.bfloat16), 80),
    "decode bf16 sm_90": lambda: compile_launch(attention("decode", torch.bfloat16), 90),
    "varlen fp16 sm_90": lambda: compile_launch(attention("varlen", torch.float16), 90),
    "reshape_and_cache bf16 sm_90": lambda: compile_launch(reshape(torch.bfloat16), 90),
    "rejection sampler sm_90": lambda: compile_launch(rejection(), 90),
}
out = {}
for name, run in cases.items():
    try:
        out[name] = {"cubin_bytes": run()}
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
print(json.dumps(out))
'''


def test_kernels_compile_for_hopper_and_ampere():
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the compile subprocess crashed:\n{proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {name: r["error"] for name, r in results.items() if "error" in r}
    assert not failed, ("kernels that do not compile for the GPU (their interpreted tests cannot see this: "
                        f"the interpreter runs the fp32 branch):\n{json.dumps(failed, indent=1)}")
    assert all(r["cubin_bytes"] > 0 for r in results.values()), "a compile produced no GPU binary"
