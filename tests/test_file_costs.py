"""`make test`'s schedule (tests/file_costs.py): files longest first from a measured
table, and the recorder that measures it. Oracles: hand-computed orders and sums."""
import json
import re
from pathlib import Path
from types import SimpleNamespace

from file_costs import CostRecorder, file_of, load_costs, order_by_cost

ROOT = Path(__file__).resolve().parent.parent


def _items(*nodeids):
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_files_go_longest_first_keeping_each_files_test_order():
    items = _items("tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2", "nb/x.ipynb::x.ipynb",
                   "tests/new.py::t", "tests/b.py::t2")
    order_by_cost(items, {"tests/a.py": 5.0, "tests/b.py": 50.0, "nb/x.ipynb": 120.0, "tests/c.py": 1.0})
    got = [i.nodeid for i in items]
    # the new file gets the median cost (27.5 s): after b.py's 50 s, before a.py's 5 s
    assert got == ["nb/x.ipynb::x.ipynb", "tests/b.py::t1", "tests/b.py::t2", "tests/new.py::t",
                   "tests/a.py::t1", "tests/a.py::t2"], (
        f"files must go out longest first (a new file at the median), each file's tests in their order: {got}")


def test_file_of_splits_only_at_the_first_separator():
    assert file_of("tests/t.py::test_x[a::b]") == "tests/t.py", "a parameter id containing :: split the path"
    assert file_of("05_mini_vllm/engine.ipynb") == "05_mini_vllm/engine.ipynb"


def test_recorder_sums_setup_call_and_teardown_per_file(tmp_path):
    rec = CostRecorder(str(tmp_path / "costs.json"))
    for nodeid, d in [("tests/a.py::t1", 1.0), ("tests/a.py::t1", 2.5), ("tests/b.py::t[x::y]", 4.0),
                      ("tests/a.py::t2", 0.5)]:
        rec.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=d))
    rec.pytest_sessionfinish(None)
    table = json.loads((tmp_path / "costs.json").read_text())
    assert table == {"tests/a.py": 4.0, "tests/b.py": 4.0}, f"per-file sums wrong: {table}"
    assert load_costs(tmp_path / "costs.json") == table


def test_the_committed_table_names_existing_files_and_make_test_keeps_its_order():
    table = load_costs()
    assert table, "tests/file_costs.json is missing or empty: run `make test-costs`"
    stale = [f for f in table if not (ROOT / f).exists()]
    assert not stale, f"tests/file_costs.json names files that no longer exist (rerun `make test-costs`): {stale}"
    xdist = re.search(r"^TEST_XDIST\s*:=(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert xdist and "--no-loadscope-reorder" in xdist.group(1), (
        "make test must pass --no-loadscope-reorder: without it pytest-xdist reorders files by their "
        "number of tests and the longest-first order is lost")
