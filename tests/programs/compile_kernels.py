"""Compile the launches the Triton kernels' wrappers make on a GPU, without a GPU.

Run by tests/test_kernels_cuda_compile.py with TRITON_INTERPRET=0 (the
interpreter is chosen when a kernel is defined, so this needs a fresh process):
each public wrapper is called on CPU tensors with a recorder in place of its
kernel, and the recorded launch (arguments, constexprs, warps) is compiled for
an H100 (sm_90) or an A100 (sm_80) with Triton's bundled ptxas.

No arguments. Prints one JSON object on its last line, case name ->
{"cubin_bytes": n} or {"error": "Type: message"}.
"""
import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64"}


class Recorder:
    """Stands in for `kernel[grid](...)`: keeps the launch instead of running it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def arg_type(a) -> str:
    if isinstance(a, torch.Tensor):
        return "*" + TYPES[a.dtype]
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i32" if -2**31 <= a < 2**31 else "i64"
    return "fp32"


def compile_launch(rec: Recorder, arch: int) -> int:
    """Size of the cubin compiled for sm_`arch` from the last recorded launch."""
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


def attention(kind: str, dtype) -> Recorder:
    from mini_vllm.kernels import paged_attention as pa

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


def reshape(dtype) -> Recorder:
    from mini_vllm.kernels import reshape_and_cache as rc

    rec = rc._reshape_and_cache_kernel = Recorder(rc._reshape_and_cache_kernel)
    kc, vc = torch.zeros(4, 16, 2, 128, dtype=dtype), torch.zeros(4, 16, 2, 128, dtype=dtype)
    k, v = torch.randn(3, 2, 128).to(dtype), torch.randn(3, 2, 128).to(dtype)
    rc.reshape_and_cache(k, v, kc, vc, torch.tensor([0, 17, -1]))
    rc._reshape_and_cache_kernel = rec.fn
    return rec


def rejection() -> Recorder:
    from mini_vllm.kernels import rejection_sampler as rs

    rec = rs._rejection_sample_kernel = Recorder(rs._rejection_sample_kernel)
    vocab = 300
    p = torch.rand(3, vocab).softmax(-1)
    rs.rejection_sample_triton(torch.tensor([1, 2, 3]), torch.tensor([2, 1]), p, p,
                               torch.tensor([4, 5]), torch.tensor([False, True]), torch.rand(3),
                               torch.rand(2, vocab))
    rs._rejection_sample_kernel = rec.fn
    return rec


CASES = {
    "varlen bf16 sm_90": lambda: compile_launch(attention("varlen", torch.bfloat16), 90),
    "varlen bf16 sm_80": lambda: compile_launch(attention("varlen", torch.bfloat16), 80),
    "decode bf16 sm_90": lambda: compile_launch(attention("decode", torch.bfloat16), 90),
    "varlen fp16 sm_90": lambda: compile_launch(attention("varlen", torch.float16), 90),
    "reshape_and_cache bf16 sm_90": lambda: compile_launch(reshape(torch.bfloat16), 90),
    "rejection sampler sm_90": lambda: compile_launch(rejection(), 90),
}


def main() -> None:
    # Imported here, not at the top: importing a kernel module defines its kernels, and a test
    # process that imported this file would define them with its own TRITON_INTERPRET.
    # Imported before the cases: a module that fails to import crashes the run, as it should.
    from mini_vllm.kernels import paged_attention, rejection_sampler, reshape_and_cache  # noqa: F401

    out = {}
    for name, run in CASES.items():
        try:
            out[name] = {"cubin_bytes": run()}
        except Exception as e:  # noqa: BLE001  (every case is reported, not only the first failure)
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
