"""The order `make test` hands test files to its workers: the longest first.

pytest-xdist with `--dist loadfile` gives each worker one file at a time, in
collection order (with `--no-loadscope-reorder`; by default it would order files
by their number of tests, which put the notebooks, one test each and the longest
files of all, at the very end, where one worker ran them while the other idled).
Sorting the files by their measured cost, longest first, is the classic
longest-processing-time rule: the last file to start is a short one, so both
workers finish close together.

The costs are seconds per file (setup, call and teardown of its tests, summed)
from a run of `make test-costs`, stored in `tests/file_costs.json`. A file not
in the table (a new one) gets the median cost, so it lands mid-schedule; the
table only orders the run, so a stale one costs time, never correctness.
"""
from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from pathlib import Path

COSTS_PATH = Path(__file__).with_name("file_costs.json")
RECORD_ENV = "MINI_VLLM_RECORD_TEST_COSTS"  # a path: write the measured costs there


def file_of(nodeid: str) -> str:
    """'tests/test_x.py::test_y[a::b]' -> 'tests/test_x.py' (a notebook's node id is its path)."""
    return nodeid.split("::", 1)[0]


def load_costs(path: Path = COSTS_PATH) -> dict[str, float]:
    if not path.exists():
        return {}
    return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}


def order_by_cost(items: list, costs: dict[str, float], key=lambda item: file_of(item.nodeid)) -> None:
    """Sort `items` in place: files by cost, longest first, ties and unknown files by
    name; the order of tests inside a file is kept (the sort is stable)."""
    default = statistics.median(costs.values()) if costs else 0.0
    items.sort(key=lambda item: (-costs.get(key(item), default), key(item)))


class CostRecorder:
    """Sums each file's test durations from the reports the controller receives
    (every worker's, under xdist) and writes them as JSON at the end of the run."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session) -> None:
        table = {k: round(v, 1) for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        self.path.write_text(json.dumps(table, indent=1) + "\n")


def recorder_from_env() -> CostRecorder | None:
    """A recorder when RECORD_ENV names a file and this process is not an xdist worker
    (the controller sees every worker's reports; a worker only its own)."""
    path = os.environ.get(RECORD_ENV)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    return CostRecorder(path)
