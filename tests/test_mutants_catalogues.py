"""The mutation catalogues stay applicable, and the runner's patching is strict.

Running the mutants takes minutes (`make mutants`); these checks take
milliseconds and catch a catalogue gone stale after an edit of the reference
(a mutant that no longer applies would stop `make mutants` with an error).
"""
import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `mutants` is a top-level folder, not part of the installed package

from mutants.core import Mutant, MutantError, apply, package_dirs, tree_path  # noqa: E402

CATALOGUES = sorted(p.stem for p in (REPO / "mutants").glob("ch*.py"))


@pytest.mark.parametrize("name", CATALOGUES)
def test_every_mutant_applies_exactly_once(name):
    mutants = importlib.import_module(f"mutants.{name}").MUTANTS
    assert len(mutants) >= 8, f"{name}: a catalogue needs at least 8 classic mistakes, has {len(mutants)}"
    names = [m.name for m in mutants]
    assert len(set(names)) == len(names), f"{name}: duplicate mutant names {names}"
    for m in mutants:
        text = (REPO / m.path).read_text()
        assert text.count(m.old) == 1, (f"{name}/{m.name}: `old` occurs {text.count(m.old)} times in {m.path}; "
                                        "the reference changed, update the mutant")
        assert m.old != m.new and m.why and m.tests, f"{name}/{m.name}: empty patch, reason or test list"
        for t in m.tests:
            assert (REPO / t.split("::")[0]).is_file(), f"{name}/{m.name}: test file {t} does not exist"


def test_tree_path_follows_package_dir():
    dirs = package_dirs(REPO)
    assert tree_path("01_paged_attention/attention.py", dirs) == "mini_vllm/paged_attention/attention.py"
    assert tree_path("06_global_prefix_cache/pool.py", dirs) == "mini_vllm/global_cache/pool.py", \
        "a chapter folder must map to its package name, not its folder name"
    assert tree_path("tests/test_x.py", dirs) == "tests/test_x.py"


def test_apply_refuses_ambiguous_or_missing_old(tmp_path):
    dirs = {"mini_vllm.paged_attention": "01_paged_attention"}
    f = tmp_path / "mini_vllm" / "paged_attention" / "m.py"
    f.parent.mkdir(parents=True)
    f.write_text("x = 1\ny = 1\n")
    mk = lambda old, new="z = 2": Mutant("m", "01_paged_attention/m.py", old, new, ["t"], "w")  # noqa: E731
    with pytest.raises(MutantError, match="does not apply: `old` occurs 2 times"):
        apply(mk("= 1"), tmp_path, dirs)
    with pytest.raises(MutantError, match="does not apply: `old` occurs 0 times"):
        apply(mk("w = 3"), tmp_path, dirs)
    with pytest.raises(MutantError, match="no longer compiles"):
        apply(mk("x = 1", "x = ("), tmp_path, dirs)
    assert f.read_text() == "x = 1\ny = 1\n", "a refused mutant must leave the file untouched"
    target, original = apply(mk("x = 1"), tmp_path, dirs)
    assert target.read_text() == "z = 2\ny = 1\n" and original == "x = 1\ny = 1\n"
