"""Build the training corpus from the running interpreter's standard library.

Invariants:
  * The file list is sorted by relative path, so the corpus is identical for a given
    Python build regardless of file-system order.
  * The train/validation split is by *file* (sha256 of the relative path), so no
    validation file ever leaks a single line into training.
  * Test suites (``test/``, ``tests/``, ``idle_test/``) and ``site-packages`` are left
    out: they are large, repetitive and not the code a learner prompts with.
"""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
VAL_PERCENT = 5  # share of files held out for validation


@dataclass(frozen=True)
class CorpusFile:
    rel: str        # path relative to the stdlib root, '/'-separated
    split: str      # "train" or "val"
    text: str


def stdlib_root(override: str | Path | None = None) -> Path:
    """The running interpreter's stdlib, or a copy of one given explicitly (to train elsewhere on the same corpus)."""
    return Path(override) if override else Path(sysconfig.get_paths()["stdlib"])


def split_of(rel: str) -> str:
    """Deterministic split: a file is held out iff its path hash falls in the first VAL_PERCENT buckets."""
    bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100
    return "val" if bucket < VAL_PERCENT else "train"


def collect_files(root: Path | None = None) -> list[CorpusFile]:
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if any(part in EXCLUDED_DIRS for part in rel.split("/")[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of legacy-encoded files; skipping keeps the corpus valid UTF-8
        if text.strip():
            out.append(CorpusFile(rel, split_of(rel), text))
    # pydoc_data/topics.py is inside the stdlib tree already; assert so the card's claim holds.
    assert any(f.rel == "pydoc_data/topics.py" for f in out), "pydoc_data/topics.py missing from corpus"
    return out


def python_version(label: str | None = None) -> str:
    if label:
        return label
    return f"{platform.python_implementation()} {platform.python_version()}"


def write_file_list(files: list[CorpusFile], path: Path, version: str, root: Path) -> None:
    """One line per file: '<split>\t<relative path>\t<characters>', after a header naming the build."""
    lines = [f"# corpus: standard library of {version} (read from {root})",
             f"# excluded directories: {sorted(EXCLUDED_DIRS)}; split: sha256(path) % 100 < {VAL_PERCENT} -> val",
             "# split\tpath\tchars"]
    lines += [f"{f.split}\t{f.rel}\t{len(f.text)}" for f in files]
    path.write_text("\n".join(lines) + "\n")


def read_file_list(path: Path) -> list[tuple[str, str]]:
    """Inverse of write_file_list: [(split, rel)]."""
    rows = []
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            split, rel, _ = line.split("\t")
            rows.append((split, rel))
    return rows
