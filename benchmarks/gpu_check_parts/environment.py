"""Where the check's code comes from, which versions it needs, what device it has.

No vLLM counterpart file; vLLM's `collect_env.py` gathers the same facts.

The check runs on a machine with its own Python, PyTorch, Triton and
transformers and nothing to download, so nothing is installed: the
`mini_vllm` package is imported from this checkout through a meta-path finder
that maps each package to its folder, as pyproject's
[tool.setuptools.package-dir] does for an install. It sits first on
`sys.meta_path`, so even where another `mini_vllm` is installed, this
checkout is what runs. Subprocesses (the pytest run) load the same finder as
a pytest plugin (`gpu_check_parts.pytest_plugin`).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import platform
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What the code needs, not what it was developed with (PyTorch 2.13, Triton
# 3.7, transformers 5.23 on CPU): transformers 5 for `dtype=` and Qwen3,
# Triton 3 for tl.dot's `input_precision`, PyTorch 2.4 for the transformers 5
# line and the profiler's kernel events used here.
MIN_VERSIONS = {"python": "3.10", "torch": "2.4", "triton": "3.0", "transformers": "5.0"}


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs

    def find_spec(self, fullname, path=None, target=None):
        folder = self.dirs.get(fullname)
        if folder is None:
            return None  # modules inside a package are found through its __path__
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def use_source_tree(children: bool = True) -> None:
    """Make `import mini_vllm` load this checkout (idempotent); with `children`,
    in the child processes started from now on too."""
    if any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        return
    if "mini_vllm" in sys.modules:
        raise RuntimeError("mini_vllm was imported before use_source_tree(); call it first")
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))  # last: only for `mutants.core`, which reads pyproject's table
    from mutants.core import package_dirs

    sys.meta_path.insert(0, _SourceTreeFinder({p: REPO / d for p, d in package_dirs(REPO).items()}))
    if children:
        _children_use_source_tree()


def _children_use_source_tree() -> None:
    """Child interpreters (the pytest run, the engine core's spawned process) do
    not inherit a meta-path finder: a `sitecustomize` on their PYTHONPATH
    installs the same one at start-up."""
    folder = Path(tempfile.mkdtemp(prefix="mini_vllm_source_tree_"))
    (folder / "sitecustomize.py").write_text(
        "# Written by gpu_check_parts.environment: import mini_vllm from the checkout.\n"
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'benchmarks')!r})\n"
        "from gpu_check_parts.environment import use_source_tree\n"
        "use_source_tree(children=False)\n")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder)] + [p for p in [os.environ.get("PYTHONPATH")] if p])


# Imported by the engine (its process boundary, structured outputs and the
# OpenAI server's models), but not part of a bare PyTorch image.
RUNTIME_MODULES = ("zmq", "msgspec", "xgrammar", "pydantic")


def missing_modules(names: tuple[str, ...] = RUNTIME_MODULES) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def install_wheels(folder: Path) -> list[str]:
    """Install the wheels in `folder` (`make gpu-wheels` fills it) into a temporary
    directory, without an index or dependencies, and put it first on this
    process's and its children's path. Returns the wheels installed; none when
    every runtime module is already importable or the folder has none."""
    import subprocess

    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels or not missing_modules():
        return []
    target = Path(tempfile.mkdtemp(prefix="mini_vllm_wheels_"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                    str(target), *map(str, wheels)], check=True)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return [w.name for w in wheels]


def parse_version(text: str) -> tuple[int, ...]:
    """'2.11.0+cu128' -> (2, 11, 0); '3.6.0rc1' -> (3, 6, 0)."""
    nums = []
    for part in text.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        nums.append(int(m.group()))
    if not nums:
        raise ValueError(f"version {text!r} does not start with a number")
    return tuple(nums)


def installed_versions() -> dict[str, str]:
    import torch
    import transformers
    import triton

    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__}


def check_versions(found: dict[str, str], need: dict[str, str] = MIN_VERSIONS) -> list[str]:
    """One message per package older than its minimum (empty: all fine)."""
    return [f"{name} {found[name]} is older than the minimum {want}" for name, want in need.items()
            if parse_version(found[name]) < parse_version(want)]


def device_info(device: str) -> dict:
    import torch

    from machine import cpu_info  # benchmarks/machine.py: the host CPU (its ISA decides the CPU tests' kernels)

    info = {"device": device, "platform": platform.platform(), "cpu_count": __import__("os").cpu_count(),
            "host_cpu": cpu_info()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(name=p.name, total_memory_bytes=p.total_memory, sm_count=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}", cuda_runtime=torch.version.cuda)
    else:
        info.update(name=platform.processor() or platform.machine(), total_memory_bytes=_host_memory_bytes())
    return info


def _host_memory_bytes() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
