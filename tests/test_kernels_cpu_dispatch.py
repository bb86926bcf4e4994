"""Which build of the C++ kernels runs (kernels/cpu_native.py): the dispatch rule on stubbed
CPU features (AVX-512 with BF16, then AVX2 + FMA, then numba; MINI_VLLM_CPU_ATTN; numba held
to another CPU), the choices refused by name, the AVX2 libraries' machine code, and the
libraries' names following their headers. The kernels' results are test_kernels_cpu_native.py's.
"""
import os
import platform
import shutil
import subprocess
import sys

import pytest

from mini_vllm.kernels import cpu_native
from kernel_cases import native_isa  # noqa: F401 (a fixture)


def test_an_unknown_choice_is_refused_at_import():
    env = dict(os.environ, MINI_VLLM_CPU_ATTN="cpp")
    out = subprocess.run([sys.executable, "-c", "import mini_vllm.kernels.cpu_native"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode != 0 and "MINI_VLLM_CPU_ATTN must be one of ('auto', 'avx512', 'avx2', 'numba')" in out.stderr, \
        "an unknown MINI_VLLM_CPU_ATTN must be refused by name, not ignored"


def test_numba_choice_and_held_back_isa_keep_the_numba_kernel(monkeypatch):
    monkeypatch.setattr(cpu_native, "CPU_ATTN", "numba")
    assert cpu_native.unavailable_reason() == "MINI_VLLM_CPU_ATTN=numba" and cpu_native.isa() is None
    monkeypatch.setattr(cpu_native, "CPU_ATTN", "auto")
    monkeypatch.setenv("NUMBA_CPU_NAME", "haswell")
    monkeypatch.setattr(cpu_native, "_state", {})  # a fresh process: the automatic choice is made once
    assert "haswell" in cpu_native.unavailable_reason("avx512"), \
        "numba held to Haswell (AVX2_ONLY_ENV) must not load AVX-512 code"
    assert cpu_native.isa() in ("avx2", None), "numba held to Haswell: only the AVX2 build may run"


# LLVM's feature names of three kinds of x86 CPU, for the dispatch rule.
AVX512_CPU = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16"})
AVX512_NO_BF16_CPU = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})  # Skylake-X
AVX2_CPU = frozenset({"avx2", "fma", "f16c"})  # Haswell, Zen 1-3
AVX2_NO_F16C_CPU = frozenset({"avx2", "fma"})  # none sold, but the AVX2 build widens fp8 bytes with F16C
OLD_CPU = frozenset({"avx", "sse4.2"})  # Sandy Bridge: no AVX2, no FMA


@pytest.mark.parametrize("features,env,want", [
    (AVX512_CPU, {}, "avx512"),
    (AVX512_NO_BF16_CPU, {}, "avx2"),
    (AVX2_CPU, {}, "avx2"),
    (OLD_CPU, {}, None),
    (AVX2_NO_F16C_CPU, {}, None),
    (AVX512_CPU, {"MINI_VLLM_CPU_ATTN": "avx2"}, "avx2"),
    (AVX512_CPU, {"NUMBA_CPU_NAME": "haswell"}, "avx2"),
], ids=["avx512-bf16", "avx512-no-bf16", "avx2", "no-avx2", "avx2-no-f16c", "forced-avx2", "numba-held-to-haswell"])
def test_dispatch_takes_the_best_build_the_cpu_runs(monkeypatch, features, env, want):
    """The rule, on any machine (the CPU's features stubbed): AVX-512 with BF16 first, then
    AVX2 + FMA + F16C, else numba; MINI_VLLM_CPU_ATTN forces a build; numba held to another CPU
    (AVX2_ONLY_ENV) runs only the AVX2 build."""
    monkeypatch.setattr(cpu_native, "_state", {"features": features})
    monkeypatch.setattr(cpu_native, "CPU_ATTN", env.get("MINI_VLLM_CPU_ATTN", "auto"))
    monkeypatch.setattr(cpu_native.platform, "machine", lambda: "x86_64")
    if "NUMBA_CPU_NAME" in env:
        monkeypatch.setenv("NUMBA_CPU_NAME", env["NUMBA_CPU_NAME"])
    else:
        monkeypatch.delenv("NUMBA_CPU_NAME", raising=False)
    got = cpu_native.isa() if cpu_native.unavailable_reason() is None else None
    assert got == want, f"CPU features {sorted(features)}, {env}: the {got} build runs, want {want}"
    if want is None:
        assert "avx2" in cpu_native.unavailable_reason(), "the reason must name what the CPU lacks"
    # forcing the AVX-512 build where the CPU lacks it keeps every call on numba
    with cpu_native.use_isa("avx512"):
        assert (cpu_native.unavailable_reason() is None) == (features == AVX512_CPU and "NUMBA_CPU_NAME" not in env), \
            "use_isa('avx512') must run only where the CPU has AVX-512 with BF16 and numba targets it"


@pytest.mark.skipif("avx2" not in cpu_native.available_isas() or shutil.which("objdump") is None,
                    reason="needs the AVX2 build and objdump")
def test_the_avx2_builds_hold_no_avx512_instruction():
    """An AVX2-only CPU faults on the first AVX-512 instruction: the AVX2 libraries (attention,
    layer ops and linear) must hold none (no zmm register, no mask register), and must use
    the 256-bit registers, or they did not vectorise."""
    for source, flags in ((cpu_native.SOURCE, cpu_native.flags("avx2")),
                          (cpu_native.LAYER_OPS_SOURCE, cpu_native.layer_ops_flags("avx2"))):
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(cpu_native._build(source, flags))],
                             capture_output=True, text=True, check=True).stdout
        zmm, masks, ymm = asm.count("%zmm"), sum(asm.count(f"%k{i}") for i in range(1, 8)), asm.count("%ymm")
        assert zmm == 0 and masks == 0 and ymm > 100, (
            f"{source.name} built for AVX2 holds {zmm} zmm and {masks} mask-register operands, {ymm} ymm "
            "(simd.h chose the AVX-512 header, or an -m flag let the compiler use AVX-512)")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64")
                    or shutil.which(cpu_native._compiler()) is None, reason="needs an x86-64 C++ compiler")
@pytest.mark.parametrize("build", list(cpu_native.ISAS))
def test_every_build_compiles_whatever_this_cpu_runs(build):
    """Every build's libraries (attention, layer ops) compile with any x86-64 g++, whether or
    not this CPU can run them: on an AVX2-only machine a mistake in the AVX-512 path
    (simd_avx512.h, the fp8 reads of attn_formats.h) shows here, not on the first AVX-512 CPU."""
    for source, flags in ((cpu_native.SOURCE, cpu_native.flags(build)),
                          (cpu_native.LAYER_OPS_SOURCE, cpu_native.layer_ops_flags(build))):
        assert cpu_native._build(source, flags).is_file(), f"{source.name}: the {build} build wrote no library"


def test_a_header_edit_rebuilds_the_library(tmp_path, native_isa):
    """Both C++ files include csrc/simd.h and the SIMD headers: a library named by its .cpp
    alone would keep serving the old code after a header changed (a stale exp, a stale
    widening)."""
    for path in (cpu_native.SOURCE.parent / "cpu_layer_ops.cpp", *cpu_native.SOURCE.parent.glob("*.h")):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    source = tmp_path / "cpu_layer_ops.cpp"
    first = cpu_native._build(source, cpu_native.layer_ops_flags(native_isa))
    header = tmp_path / f"simd_{native_isa}.h"
    header.write_text(header.read_text() + "\n// an edit\n")
    second = cpu_native._build(source, cpu_native.layer_ops_flags(native_isa))
    assert first != second and first.is_file() and second.is_file(), \
        "editing the shared header must build a library under a new name (the header is part of the hash)"
