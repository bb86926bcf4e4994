"""One package for speculative decoding: `mini_vllm.spec_decode` is Chapter 4, and Chapter 5's
engine side is its subpackage `mini_vllm.spec_decode.engine` (vLLM: `vllm/v1/spec_decode/`).

Chapter 4 must stay usable without Chapter 5 (imports go one way, 04 <- 05); the engine's
former package name is gone, not kept as an alias.
"""
import importlib
import subprocess
import sys

import pytest


def test_chapter_4_imports_nothing_of_chapter_5():
    code = ("import sys, mini_vllm.spec_decode\n"
            "print(sorted(m for m in sys.modules if m.startswith(('mini_vllm.spec_decode.engine', "
            "'mini_vllm.worker', 'mini_vllm.engine', 'mini_vllm.config'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", (
        f"importing Chapter 4 loaded Chapter 5's modules {out.strip()}: the imports must go 04 <- 05")


def test_the_engine_side_is_a_subpackage_of_chapter_4():
    eagle = importlib.import_module("mini_vllm.spec_decode.engine.eagle")
    assert eagle.EagleProposer.__module__ == "mini_vllm.spec_decode.engine.eagle"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mini_vllm.speculative")  # the former second name of the concept
