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

It runs in a subprocess (tests/programs/compile_kernels.py): TRITON_INTERPRET is
read when a kernel is defined, and tests/conftest.py sets it to 1 for this process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROGRAMS = Path(__file__).resolve().parent / "programs"


def test_kernels_compile_for_hopper_and_ampere():
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(PROGRAMS / "compile_kernels.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"the compile subprocess crashed:\n{proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {name: r["error"] for name, r in results.items() if "error" in r}
    assert not failed, ("kernels that do not compile for the GPU (their interpreted tests cannot see this: "
                        f"the interpreter runs the fp32 branch):\n{json.dumps(failed, indent=1)}")
    assert all(r["cubin_bytes"] > 0 for r in results.values()), "a compile produced no GPU binary"
