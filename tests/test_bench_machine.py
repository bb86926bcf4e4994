"""The machine line every speed ratio is printed with (`benchmarks/machine.py`):
the CPU and the ISA flags that change which code is fastest must be read right,
or a ratio gets attributed to the wrong machine."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from machine import machine_line, parse_cpuinfo  # noqa: E402

ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC 9R45
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512_bf16 avx512vl

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: not this block
flags\t\t: amx_bf16
"""
AVX2_ONLY = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7R13 Processor
flags\t\t: fpu sse2 avx avx2 fma
"""


def test_cpuinfo_fields_and_isa_flags():
    z = parse_cpuinfo(ZEN5)
    assert (z["model_name"], z["vendor"], z["family"], z["model"]) == ("AMD EPYC 9R45", "AuthenticAMD", "26", "2"), \
        f"the first processor block was misread: {z}"
    assert z["isa"] == ["AVX2", "AVX-512F", "AVX512_BF16"], \
        f"ISA flags {z['isa']}: a later processor block's flags (amx_bf16) leaked in, or a flag was missed"
    a = parse_cpuinfo(AVX2_ONLY)
    assert a["isa"] == ["AVX2"], f"an AVX2-only CPU reported {a['isa']}: the AVX-512 path would be claimed wrongly"
    assert parse_cpuinfo("")["isa"] == [], "no cpuinfo must mean no ISA claimed"


def test_machine_line_names_the_isa_and_a_measured_bandwidth():
    line = machine_line((1,))
    assert line.startswith("machine: ") and "ISA: " in line, f"machine line lacks the CPU or its ISA: {line!r}"
    bw = float(line.split("read bandwidth ")[1].split(" GB/s")[0])
    assert bw > 0.1, f"read bandwidth {bw} GB/s: the probe did not time a real pass over memory"
