"""The README's exercise table is what an untouched exercise run prints.

One command per chapter, the same string in the README row, the chapter's
`exercise.py` docstring and its notebook; it must fail on an untouched
exercise, and the README's counts must be the counts that run gives.

The run: every chapter's exercise tests in one pytest subprocess (one start-up
instead of six; the tests are independent, so per-chapter counts equal those
of the per-chapter commands), on a copy of the package whose `exercise.py`
files are the committed ones (git HEAD), so a learner's work in progress does
not change what "untouched" means. About 40 s on 2 cores, most of it
collection; it is part of `make test`.
"""
import json
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `mutants` is a top-level folder, not part of the installed package

from mutants.core import _env, build_tree, tree_path  # noqa: E402

CHAPTERS = {  # chapter: (folder, notebook with the "your turn" section)
    "1": ("01_paged_attention", "paged_attention.ipynb"),
    "2": ("02_kvcache", "prefix_caching.ipynb"),
    "3": ("03_scheduler", "scheduler.ipynb"),
    "4": ("04_spec_decode", "spec_decode.ipynb"),
    "5": ("05_mini_vllm", "engine.ipynb"),
    "6": ("06_global_prefix_cache", "global_prefix_cache.ipynb"),
}
ROW = re.compile(r"^\| (\d) [^|]+\| `([^`]+)` \| ([^|]+) \| (\d+) passed \|$")
COMMAND = re.compile(r"[^`'\"\n]*--impl=exercise")


def readme_rows() -> dict[str, tuple[str, str, int]]:
    """chapter -> (command, untouched counts, solved count) from the README table."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Doing an exercise", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = ROW.match(line.strip())
        if m:
            rows[m[1]] = (m[2], m[3].strip(), int(m[4]))
    assert sorted(rows) == sorted(CHAPTERS), f"the README's exercise table has rows for {sorted(rows)}"
    return rows


def commands_in(text: str) -> set[str]:
    return {c.strip().strip("`").strip() for c in COMMAND.findall(text)}


def notebook_text(path: Path) -> str:
    nb = json.loads(path.read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"])


@pytest.mark.parametrize("ch", sorted(CHAPTERS))
def test_one_command_per_exercise_everywhere(ch):
    command = readme_rows()[ch][0]
    assert command == f".venv/bin/pytest -q tests/test_ch{ch}_*.py --impl=exercise", \
        f"chapter {ch}: the README's command {command!r} does not follow the course's one form"
    folder, notebook = CHAPTERS[ch]
    for where, text in ((f"{folder}/exercise.py", (REPO / folder / "exercise.py").read_text()),
                        (f"{folder}/{notebook}", notebook_text(REPO / folder / notebook))):
        found = commands_in(text)
        # Besides the chapter's command, a part of it may name its own command while a learner works
        # on it (Chapter 5's EAGLE proposer): the same form on one of the chapter's test files.
        parts = {c for c in found - {command} if re.fullmatch(rf"\.venv/bin/pytest -q (tests/test_ch{ch}_\w+\.py) "
                                                                r"--impl=exercise", c)
                 and (REPO / c.split()[2]).is_file()}
        assert found - parts == {command}, (f"chapter {ch}: {where} gives {sorted(found)} as the exercise command; "
                                            f"the README gives {command!r}: one command everywhere (a part's "
                                            "own command must name one existing test file of the chapter)")


def _summary(counts: dict[str, int]) -> str:
    """pytest's wording: '28 failed, 11 passed', zero counts left out."""
    return ", ".join(f"{counts[k]} {k}" for k in ("failed", "passed", "skipped", "errors") if counts.get(k))


def untouched_counts() -> dict[str, dict[str, int]]:
    dirs_tree = tempfile.TemporaryDirectory(prefix="mini_vllm_exercises_")
    with dirs_tree as tmp:
        tree = Path(tmp)
        dirs = build_tree(tree)
        for folder, _ in CHAPTERS.values():  # the committed exercise, not a learner's edits
            rel = f"{folder}/exercise.py"
            head = subprocess.run(["git", "-C", str(REPO), "show", f"HEAD:{rel}"], capture_output=True, text=True)
            if head.returncode == 0:
                (tree / tree_path(rel, dirs)).write_text(head.stdout)
        env = _env(tree)
        env.pop("HYPOTHESIS_PROFILE")  # --impl=exercise picks its own profile, as in the learner's run
        tests = [f"tests/test_ch{ch}_*.py" for ch in CHAPTERS]
        files = sorted(str(p.relative_to(tree)) for t in tests for p in tree.glob(t))
        xml = tree / "junit.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--tb=no", "-p", "no:cacheprovider",
                               "--impl=exercise", f"--junitxml={xml}", *files],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=600)
        assert xml.is_file(), f"the exercise run wrote no report: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        counts: dict[str, dict[str, int]] = {ch: {} for ch in CHAPTERS}
        for case in ET.parse(xml).getroot().iter("testcase"):
            m = re.search(r"test_ch(\d)_", case.get("classname", ""))
            assert m, f"unexpected test {case.get('classname')}"
            kind = ("failed" if case.find("failure") is not None else "errors" if case.find("error") is not None
                    else "skipped" if case.find("skipped") is not None else "passed")
            counts[m[1]][kind] = counts[m[1]].get(kind, 0) + 1
        return counts


@pytest.fixture(scope="module")
def counts():
    return untouched_counts()


def test_readme_table_matches_an_untouched_exercise_run(counts):
    rows = readme_rows()
    for ch, (command, untouched, solved) in sorted(rows.items()):
        got = counts[ch]
        assert got.get("failed", 0) + got.get("errors", 0) > 0, \
            f"chapter {ch}: `{command}` passes on an untouched exercise.py, so it cannot tell a learner anything"
        assert _summary(got) == untouched, (f"chapter {ch}: the README says `{command}` gives {untouched!r} on an "
                                            f"untouched exercise.py; the run gives {_summary(got)!r}")
        assert sum(got.values()) == solved, (f"chapter {ch}: the README says {solved} tests pass once the exercise "
                                             f"is solved; the command runs {sum(got.values())}")
