"""Mutation testing: plant a classic mistake in the reference, check the tests catch it.

No vLLM counterpart (vLLM has no mutation suite); this is the course's proof
that each chapter's tests are a specification and not a smoke test.

A `Mutant` is a one-spot text patch (`old` -> `new`) of one reference file.
The runner never touches the working tree. It copies the package into a
temporary directory laid out as the installed `mini_vllm` package (chapter
folders mapped per pyproject's package-dir), plus `tests/` and `pyproject.toml`,
patches the copy, and runs pytest there in a subprocess with that directory
first on PYTHONPATH (a plain path entry wins over the editable-install finder,
which setuptools appends to `sys.meta_path`).

Invariants:
- `old` occurs exactly once in its file, else the mutant "does not apply" and
  the run stops (a stale mutant would otherwise pass silently as "caught").
- A mutant counts as caught only if pytest reports a failing test; a mutant
  that does not compile or makes the package unimportable is a bad mutant.
- Every run is deterministic: HYPOTHESIS_PROFILE=mutants (derandomized, no
  shrinking; see tests/conftest.py) and a 60 s limit per mutant.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 60.0
# Lines of pytest output that mean the harness, not the code under test, broke.
_HARNESS_ERRORS = ("ImportError", "ModuleNotFoundError", "SyntaxError", "IndentationError", "ERROR collecting")


@dataclass(frozen=True)
class Mutant:
    """One planted mistake: replace `old` by `new` in the reference file `path`."""

    name: str
    path: str  # repo-relative, e.g. "01_paged_attention/attention.py"
    old: str
    new: str
    tests: list[str] = field(default_factory=list)  # pytest args, repo-relative
    why: str = ""  # the classic mistake, one line


@dataclass
class Result:
    chapter: str
    mutant: Mutant
    status: str  # "caught", "SURVIVED", "TIMEOUT", "BAD MUTANT"
    seconds: float
    message: str

    @property
    def ok(self) -> bool:
        return self.status == "caught"


class MutantError(RuntimeError):
    """A catalogue entry is wrong (does not apply, bad path); never a test result."""


def package_dirs(repo: Path = REPO) -> dict[str, str]:
    """pyproject's [tool.setuptools.package-dir]: package name -> repo-relative folder."""
    text = (repo / "pyproject.toml").read_text()
    try:
        import tomllib
        return dict(tomllib.loads(text)["tool"]["setuptools"]["package-dir"])
    except ImportError:  # Python 3.10: the table is simple `"a" = "b"` lines
        table = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
        return dict(re.findall(r'^"([^"]+)"\s*=\s*"([^"]+)"', table, flags=re.M))


def tree_path(rel: str, dirs: dict[str, str]) -> str:
    """Where repo-relative `rel` lives in the temporary tree (longest package-dir prefix wins)."""
    best = max((d for d in dirs.values() if rel.startswith(d.rstrip("/") + "/")), key=len, default=None)
    if best is None:
        return rel  # tests/, pyproject.toml: same place
    pkg = next(p for p, d in dirs.items() if d == best)
    return pkg.replace(".", "/") + rel[len(best):]


def build_tree(dest: Path, repo: Path = REPO) -> dict[str, str]:
    """Copy the package (as installed), tests/, training/ (whose plain-PyTorch EAGLE head is
    an oracle of tests/test_ch5_eagle.py), benchmarks/ (scripts some tests measure with)
    and pyproject.toml into `dest`."""
    dirs = package_dirs(repo)
    ignore = shutil.ignore_patterns("__pycache__", "*.ipynb", ".ipynb_checkpoints", "*.pyc")
    # Parents before children, so a nested mapping (mini_vllm.models) lands inside its parent.
    for pkg, src in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):
        if (repo / src).is_dir():
            shutil.copytree(repo / src, dest / pkg.replace(".", "/"), ignore=ignore, dirs_exist_ok=True)
    shutil.copytree(repo / "tests", dest / "tests", ignore=ignore, dirs_exist_ok=True)
    shutil.copytree(repo / "training", dest / "training", ignore=ignore, dirs_exist_ok=True)
    # Tests that measure against a benchmark's own script import it (the accuracy tests).
    shutil.copytree(repo / "benchmarks", dest / "benchmarks", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "gpu_reports"))
    shutil.copy2(repo / "pyproject.toml", dest / "pyproject.toml")
    return dirs


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(HYPOTHESIS_PROFILE="mutants", PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", COLUMNS="400",
               MINI_VLLM_MODELS_DIR=env.get("MINI_VLLM_MODELS_DIR", str(REPO / "models")))
    if "TRITON_INTERPRET" not in env:
        try:
            import torch
            if not torch.cuda.is_available():
                env["TRITON_INTERPRET"] = "1"
        except ImportError:
            env["TRITON_INTERPRET"] = "1"
    return env


def run_pytest(tree: Path, tests: list[str], timeout: float = TIMEOUT_S) -> tuple[int | None, float, str]:
    """(exit code or None on timeout, seconds, combined output) of pytest in `tree`."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=_env(tree), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, time.monotonic() - start, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: pytest may have children
        out, _ = proc.communicate()
        return None, time.monotonic() - start, out


def first_failure(output: str) -> str:
    """The first failing test's assertion message, from pytest's short summary."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ", 1)[1].strip() if " - " in line else line.strip()
    for line in output.splitlines():
        if line.startswith("E "):
            return line[1:].strip()
    tail = [ln for ln in output.splitlines() if ln.strip()]
    return tail[-1] if tail else "(no output)"


def apply(mutant: Mutant, tree: Path, dirs: dict[str, str]) -> tuple[Path, str]:
    """Patch the copy in `tree`; return (patched file, its original text) for restoring."""
    target = tree / tree_path(mutant.path, dirs)
    if not target.is_file():
        raise MutantError(f"mutant {mutant.name} does not apply: no file {mutant.path}")
    original = target.read_text()
    count = original.count(mutant.old)
    if count != 1:
        raise MutantError(f"mutant {mutant.name} does not apply: `old` occurs {count} times in {mutant.path} "
                          "(it must occur exactly once)")
    patched = original.replace(mutant.old, mutant.new)
    if target.suffix == ".py":  # C++ sources are compiled by the code under test (kernels/cpu_native.py)
        try:
            compile(patched, str(target), "exec")
        except SyntaxError as e:
            raise MutantError(f"mutant {mutant.name} is a bad mutant: {mutant.path} no longer compiles ({e})") from e
    target.write_text(patched)
    return target, original


def run_mutant(chapter: str, mutant: Mutant, tree: Path, dirs: dict[str, str]) -> Result:
    if not mutant.tests:
        raise MutantError(f"mutant {mutant.name} names no tests")
    target, original = apply(mutant, tree, dirs)
    try:
        code, secs, out = run_pytest(tree, mutant.tests)
    finally:
        target.write_text(original)
    msg = first_failure(out)
    if code is None:
        return Result(chapter, mutant, "TIMEOUT", secs, f"no failure within {TIMEOUT_S:.0f} s")
    if code == 0:
        return Result(chapter, mutant, "SURVIVED", secs, "all tests passed")
    if code != 1 or any(h in msg for h in _HARNESS_ERRORS):
        return Result(chapter, mutant, "BAD MUTANT", secs, f"pytest exit {code}: {msg}")
    return Result(chapter, mutant, "caught", secs, msg)


def check_tree(tree: Path) -> None:
    """The subprocess must import mini_vllm from the copy, not from the working tree."""
    code = "import mini_vllm, sys; sys.stdout.write(mini_vllm.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=_env(tree), capture_output=True, text=True)
    if out.returncode or not Path(out.stdout).resolve().is_relative_to(tree.resolve()):
        raise MutantError(f"mini_vllm is imported from {out.stdout or out.stderr!r}, not from the copy {tree}")


def run_catalogue(catalogue: dict[str, list[Mutant]], only: str | None = None, baseline: bool = True,
                  report=print) -> list[Result]:
    """Run every mutant of every chapter in `catalogue` (chapter -> mutants).

    With `baseline`, the unmutated tests of each chapter must pass first:
    otherwise "caught" would mean nothing.
    """
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="mini_vllm_mutants_") as tmp:
        tree = Path(tmp)
        dirs = build_tree(tree)
        check_tree(tree)
        for chapter, mutants in catalogue.items():
            chosen = [m for m in mutants if only is None or m.name == only]
            if baseline and chosen:
                tests = sorted({t for m in chosen for t in m.tests})
                code, secs, out = run_pytest(tree, tests, timeout=10 * TIMEOUT_S)
                if code != 0:
                    raise MutantError(f"chapter {chapter}: the unmutated tests fail ({first_failure(out)}); "
                                      "fix them before judging mutants")
                report(f"chapter {chapter}: unmutated tests pass ({secs:.1f} s)")
            for m in chosen:
                r = run_mutant(chapter, m, tree, dirs)
                report(format_row(r))
                results.append(r)
    return results


HEADER = f"{'ch':<3} {'mutant':<34} {'result':<10} {'secs':>5}  first failure"


def format_row(r: Result, width: int = 150) -> str:
    msg = r.message if len(r.message) <= width else r.message[: width - 3] + "..."
    return f"{r.chapter:<3} {r.mutant.name:<34} {r.status:<10} {r.seconds:>5.1f}  {msg}"
