"""The machine matrix in the README (`benchmarks/machine_matrix.py`) is the rendering of the
rows the benchmark recorded, never a table edited by hand."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import machine_matrix as mm  # noqa: E402


def test_readme_table_is_the_recorded_rows():
    text = mm.README.read_text()
    block = text.split(mm.START, 1)[1].split(mm.END, 1)[0].strip()
    assert block == mm.render(mm.load()), (
        "the README's machine matrix differs from benchmarks/machine_matrix.json: a row was edited by hand or the "
        "file changed without `python benchmarks/machine_matrix.py`")


def test_record_appends_rows_and_rewrites_the_table(tmp_path):
    path, readme = tmp_path / "m.json", tmp_path / "README.md"
    readme.write_text(f"intro\n{mm.START}\nstale\n{mm.END}\nafter\n")
    row = {"date": "2026-11-28", "machine": "machine: X CPU (v, family 1 model 2), 2 cores usable, ISA: AVX2; read "
           "bandwidth 9.0 GB/s with 1 thread", "workload": "tiny fp32", "threads": 1, "ratio": 1.234, "runs": 3,
           "source": "bench"}
    mm.record([row], path, readme)
    mm.record([dict(row, threads=2, ratio=0.9)], path, readme)
    assert [r["threads"] for r in mm.load(path)] == [1, 2], "a recorded row was lost or reordered"
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("after\n") and "stale" not in text, \
        "only the block between the markers may change"
    line = next(ln for ln in text.splitlines() if "tiny fp32" in ln)
    assert "X CPU (v, family 1 model 2), 2 cores usable, ISA: AVX2 |" in line and "read bandwidth" not in line, \
        f"the CPU column must be the machine line without its bandwidths: {line}"
    assert "1.23× (3 runs)" in line and "0.90× (3 runs)" in line, \
        f"both thread counts of one machine, workload and date belong on one line: {line}"
    with pytest.raises(ValueError, match="lacks \\['ratio'\\]"):
        mm.record([{k: v for k, v in row.items() if k != "ratio"}], path, readme)
