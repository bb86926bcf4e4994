"""Go-to-definition as an editor does it: jedi (the engine behind jedi-language-server,
Jupyter's and IPython's completion) resolves the course's imports statically, without
running any import hook.

The chapter folders (`02_kvcache/`, ...) are not importable names; `make install`
maps them to `mini_vllm.kvcache`, ... with a strict editable install: a tree of
links under `build/` that a static tool can walk (a lenient editable install maps
them with an import hook, which no editor runs). Pylance follows the same `.pth`
path entry. `mini_vllm`'s lazily served public names (`LLM`, ...) are spelled out
under `TYPE_CHECKING` for the same reason.

Oracle: each jump must land on the file that defines the name, in its chapter
folder (symlinks resolved), on the line of its `class` / `def`."""
import sys
from pathlib import Path

import pytest

jedi = pytest.importorskip("jedi")

ROOT = Path(__file__).resolve().parents[1]
HOW = ("run `make install` (a strict editable install: a link tree editors can follow); "
       "a lenient editable install maps the chapters with an import hook that no editor runs")

# (source, name to jump from, the file that defines it, the definition's first words)
IMPORTS = [
    ("from mini_vllm.paged_attention import BlockAllocator", "01_paged_attention/kv_cache.py", "class BlockAllocator"),
    ("from mini_vllm.kvcache import KVCacheManager", "02_kvcache/kv_cache_manager.py", "class KVCacheManager"),
    ("from mini_vllm.kvcache.kv_cache_utils import cdiv", "02_kvcache/kv_cache_utils.py", "def cdiv"),
    ("from mini_vllm.scheduler import Scheduler", "03_scheduler/scheduler.py", "class Scheduler"),
    ("from mini_vllm.scheduler.step import StepState", "03_scheduler/step.py", "class StepState"),
    ("from mini_vllm.spec_decode import NgramProposer", "04_spec_decode/ngram_proposer.py", "class NgramProposer"),
    ("from mini_vllm.global_cache import GlobalCacheConnector", "06_global_prefix_cache/connector.py",
     "class GlobalCacheConnector"),
    ("from mini_vllm.kernels.reshape_and_cache import reshape_and_cache", "kernels/reshape_and_cache.py",
     "def reshape_and_cache"),
    ("from mini_vllm import LLM", "05_mini_vllm/entrypoints/llm.py", "class LLM"),
    ("from mini_vllm import SamplingParams", "05_mini_vllm/sampling_params.py", "class SamplingParams"),
    ("from mini_vllm.engine.core_client import SyncMPClient", "05_mini_vllm/engine/core_client.py",
     "class SyncMPClient"),
]


@pytest.fixture(scope="module")
def project():
    return jedi.Project(ROOT, environment_path=sys.executable)


def _land(defs) -> tuple[Path, str]:
    assert len(defs) == 1, f"jedi found {len(defs)} definitions, want exactly one: {HOW}"
    d = defs[0]
    assert d.module_path is not None, f"jedi found {d.name!r} but no file: {HOW}"
    path = Path(d.module_path).resolve()
    return path, path.read_text().splitlines()[d.line - 1].strip()


@pytest.mark.parametrize("source,where,starts", IMPORTS, ids=[w for _, w, _ in IMPORTS])
def test_an_import_jumps_to_its_definition(project, source, where, starts):
    name = source.split()[-1]
    code = f"{source}\n{name}\n"
    path, line = _land(jedi.Script(code, project=project).goto(2, 1, follow_imports=True))
    assert path == ROOT / where, f"{source!r} jumped to {path}, want {ROOT / where}: {HOW}"
    assert line.startswith(starts), f"{source!r} jumped to the line {line!r}, want one starting {starts!r}"


def _find(path: Path, needle: str) -> tuple[str, int, int]:
    code = path.read_text()
    for i, text in enumerate(code.splitlines()):
        if needle in text:
            return code, i + 1, text.index(needle)
    raise AssertionError(f"{needle!r} is no longer in {path}: update this test's example")


# (file, the text of the use, the part of it before the name, the file that defines it, its first words)
USES = [
    # Engine to chapter: the `Scheduler` the engine core builds is Chapter 3's.
    ("05_mini_vllm/engine/core.py", "self.scheduler = Scheduler(", "self.scheduler = ", "03_scheduler/scheduler.py",
     "class Scheduler"),
    # Chapter to chapter: Chapter 3's `cdiv` is Chapter 2's.
    ("03_scheduler/scheduler_base.py", "import cdiv", "import ", "02_kvcache/kv_cache_utils.py", "def cdiv"),
]


@pytest.mark.parametrize("where,use,before,defined_in,starts", USES, ids=["engine-to-chapter", "chapter-to-chapter"])
def test_a_use_jumps_into_another_package(project, where, use, before, defined_in, starts):
    f = ROOT / where
    code, line, col = _find(f, use)
    col += len(before)
    path, text = _land(jedi.Script(code, path=f, project=project).goto(line, col + 1, follow_imports=True))
    assert path == ROOT / defined_in and text.startswith(starts), \
        f"{use!r} in {where} jumped to {path}: {text!r}, want {defined_in} ({starts}); {HOW}"


def test_completion_on_an_attribute_of_a_chapter_class(project):
    """`self.scheduler.` in the engine core completes with the Chapter 3 scheduler's methods."""
    f = ROOT / "05_mini_vllm/engine/core.py"
    code, line, col = _find(f, "outputs = self.scheduler.update_from_output(")
    col += len("outputs = self.scheduler.")
    names = {c.name for c in jedi.Script(code, path=f, project=project).complete(line, col)}
    missing = {"schedule", "update_from_output", "add_request", "finish_requests"} - names
    assert not missing, f"completion on self.scheduler. misses {sorted(missing)}: {HOW}"


def test_every_package_folder_is_listed_in_pyproject():
    """A strict editable install (and a wheel) holds only the packages pyproject.toml
    lists; a lenient one found unlisted subfolders through the import hook, which hid
    a missing entry until the link tree came."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(setup["packages"]), setup["package-dir"]
    found = set()
    for pkg, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            if ".ipynb_checkpoints" not in rel and "__pycache__" not in rel:
                found.add(".".join((pkg, *rel)))
    missing = sorted(found - listed)
    assert not missing, (f"{missing} missing from pyproject.toml's [tool.setuptools] packages: the strict "
                         "editable install of `make install` (and a wheel) leaves them out")
