"""The machine matrix: mini-vLLM / vLLM offline throughput per CPU kind, kept by the benchmark.

No vLLM counterpart. A speed ratio holds only for the CPU it was measured on (the CPU kind
changes from one machine to the next: AVX2 only, AVX-512 with BF16, AMX), so every side-by-side
result is one row: the machine line (`machine.py`), the date, the workload, the thread count,
the ratio of medians and the runs behind it. `bench_engine_throughput.py --record` appends its
rows to `machine_matrix.json`; `render()` makes the table, which the README holds between the
markers below and `engine.ipynb` shows. `tests/test_machine_matrix.py` fails when the README's
table is not the rendering of the file, so the table is never edited by hand.

Run: .venv/bin/python benchmarks/machine_matrix.py   # rewrites the README's table from the file
"""
from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
MATRIX = HERE / "machine_matrix.json"
README = HERE.parent / "README.md"
START, END = "<!-- machine-matrix:start -->", "<!-- machine-matrix:end -->"
FIELDS = ("date", "machine", "workload", "threads", "ratio", "runs", "source")


def load(path: Path = MATRIX) -> list[dict]:
    rows = json.loads(path.read_text()) if path.is_file() else []
    for i, row in enumerate(rows):
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path.name} row {i} lacks {missing}: every row needs {list(FIELDS)}")
    return rows


def record(rows: list[dict], path: Path = MATRIX, readme: Path = README) -> None:
    """Appends `rows` (each with FIELDS) to the file and rewrites the README's table."""
    for row in rows:
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise ValueError(f"a machine-matrix row lacks {missing}: {row}")
    path.write_text(json.dumps(load(path) + rows, indent=1) + "\n")
    write_readme(readme, path)


def _ratio(r: dict) -> str:
    """A ratio of medians, or the range [low, high] an earlier set of runs gave."""
    v = r["ratio"]
    text = f"{v[0]:.2f}–{v[1]:.2f}×" if isinstance(v, list) else f"{v:.2f}×"
    if not r["runs"]:
        return f"{text} (runs not recorded)"
    return f"{text} ({r['runs']} run{'s' if r['runs'] > 1 else ''})"


def cpu_of(machine: str) -> str:
    """The CPU part of a machine line: name, family/model and ISA, without the bandwidths."""
    m = re.match(r"machine: (.*?); read bandwidth", machine)
    return m.group(1) if m else machine


def render(rows: list[dict]) -> str:
    """One line per (CPU, workload, date); the thread counts side by side."""
    groups: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        groups.setdefault((cpu_of(r["machine"]), r["workload"], r["date"], r["source"]), {})[int(r["threads"])] = r
    lines = ["| CPU (machine line) | workload | date | mini-vLLM / vLLM, 1 thread | 2 threads | source |",
             "|---|---|---|---|---|---|"]
    for (cpu, workload, date, source), by_threads in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                                             kv[0][2])):
        cells = []
        for t in (1, 2):
            r = by_threads.get(t)
            cells.append("not run" if r is None else _ratio(r))
        lines.append(f"| {cpu} | {workload} | {date} | {cells[0]} | {cells[1]} | {source} |")
    return "\n".join(lines)


def write_readme(readme: Path = README, path: Path = MATRIX) -> None:
    text = readme.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{readme} has no {START} ... {END} block for the machine matrix")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{render(load(path))}\n{END}{tail}")


if __name__ == "__main__":
    write_readme()
    print(render(load()))
