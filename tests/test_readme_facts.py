"""The README's facts that can go stale are held to the repository.

The exercise table is checked by `test_exercise_table.py` (it runs the commands). This file checks
the rest a newcomer acts on: every chapter notebook appears on the recommended path, every `make`
target the README names exists, and the README counts no tests or notebooks of the suite outside a
dated report (a count of the suite is printed by `make test` itself, and goes stale with any commit).
"""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else len(README)]


def test_every_notebook_is_on_the_recommended_path():
    path = section("A recommended path")
    notebooks = sorted(p.name for p in REPO.glob("0*/*.ipynb"))
    missing = [n for n in notebooks if f"`{n}`" not in path]
    assert notebooks and not missing, f"notebooks the recommended path never names: {missing}"


def test_every_make_target_named_exists():
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), flags=re.M))
    named = set(re.findall(r"`make ([a-z][\w-]*)", README)) | set(re.findall(r"\bmake ([a-z][\w-]*)`", README))
    assert named and not named - targets, f"the README names make targets the Makefile lacks: {named - targets}"


def test_no_undated_count_of_the_suite():
    stale = [line for line in README.splitlines()
             if re.search(r"\b\d[\d,]* (?:tests|notebooks|test files)\b", line) and not re.search(r"20\d\d-\d\d", line)]
    assert not stale, ("the README counts tests or notebooks without the date of the run it read them from "
                       f"(such a count goes stale with the next test added): {stale}")
