"""Importing the course never changes the process environment. Triton's interpreter
is selected by a call (`mini_vllm.kernels.prepare_triton`, kernels/triton_setup.py)
made by the code that chose a Triton kernel, before `triton` is imported; inductor's
cache folder is chosen when a model is compiled (`compilation/backends.py`).

Each check runs in a fresh interpreter whose environment lacks TRITON_INTERPRET
(tests/conftest.py sets it for this process). Oracles: the environment itself,
before and after; the engine's tokens with the torch backend in the same process.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from test_import_graph import ROOT, module_files, package_dirs

TRITON_MODULES = {"mini_vllm.kernels.paged_attention", "mini_vllm.kernels.paged_attention_split",
                  "mini_vllm.kernels.reshape_and_cache", "mini_vllm.kernels.rejection_sampler",
                  "mini_vllm.kernels.fused_moe"}
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA no interpreter is selected")

IMPORT_ALL = r"""
import importlib, json, os, sys
import torch._inductor  # torch's own side effect (it writes TORCHINDUCTOR_CACHE_DIR), before the snapshot
before, out = dict(os.environ), {"changed": [], "refused": [], "failed": []}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError as e:
        if "prepare_triton" in str(e):
            out["refused"].append(name)
        elif (getattr(e, "name", None) or "mini_vllm").split(".")[0] == "mini_vllm":
            out["failed"].append(f"{name}: {e!r}")
    except Exception as e:
        out["failed"].append(f"{name}: {e!r}")
    now = dict(os.environ)
    if now != before:
        out["changed"].append([name, sorted(set(now.items()) ^ set(before.items()))])
        before = now
out["triton_imported"] = "triton" in sys.modules
print(json.dumps(out))
"""


def _run(code: str, *args: str, timeout=300, **env_changes) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TORCHINDUCTOR_CACHE_DIR")}
    env.update(OMP_NUM_THREADS="1", **env_changes)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_no_module_changes_the_environment_when_imported():
    names = sorted(m for m in module_files(package_dirs()) if not m.endswith("__main__"))
    r = _run(IMPORT_ALL, *names)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["failed"], f"modules that failed to import: {out['failed']}"
    assert not out["changed"], f"importing these modules changed the process environment: {out['changed']}"
    assert set(out["refused"]) == TRITON_MODULES, (
        "without CUDA and with TRITON_INTERPRET unset, exactly the Triton kernel modules must refuse to import "
        f"(naming prepare_triton) instead of defining kernels that cannot launch: refused {sorted(out['refused'])}")


def test_the_triton_backend_selects_the_interpreter_when_chosen():
    code = r"""
import os, sys
from mini_vllm import LLM, SamplingParams
from mini_vllm.course.tiny_models import model_path
sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
kw = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, block_size=16)
torch_out = LLM(str(model_path("tiny-py-target")), attention_backend="torch", **kw).generate(
    [{"prompt_token_ids": [5, 6, 7, 8, 9]}], sp, use_tqdm=False)[0].outputs[0].token_ids
assert "TRITON_INTERPRET" not in os.environ, "the torch backend's engine selected Triton's interpreter"
triton_out = LLM(str(model_path("tiny-py-target")), attention_backend="triton", **kw).generate(
    [{"prompt_token_ids": [5, 6, 7, 8, 9]}], sp, use_tqdm=False)[0].outputs[0].token_ids
print(os.environ.get("TRITON_INTERPRET"), torch_out == triton_out, torch_out, triton_out)
"""
    r = _run(code)
    assert r.returncode == 0, f"the Triton backend failed on a CPU without TRITON_INTERPRET set:\n{r.stderr[-3000:]}"
    interp, same, *_ = r.stdout.split()
    assert interp == "1", "choosing the Triton backend on a CPU did not select the interpreter"
    assert same == "True", f"Triton and torch backends disagree: {r.stdout}"


def test_triton_imported_before_the_interpreter_is_refused_naming_the_cause():
    r = _run("import triton\nfrom mini_vllm.kernels import prepare_triton\nprepare_triton()")
    assert r.returncode != 0 and "already imported" in r.stderr, (
        "prepare_triton after `import triton` must refuse (tl.sum and the others are fixed compiled-only by "
        f"then), not set the variable too late: {r.stderr[-1500:]}")


def test_compiled_pieces_cache_in_the_courses_folder_unless_the_user_chose_one(tmp_path):
    code = ("import os\nfrom mini_vllm.compilation.backends import inductor_cache_dir\n"
            "import torch._inductor\nprint(inductor_cache_dir())")
    r = _run(code, XDG_CACHE_HOME=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == str(tmp_path / "mini_vllm" / "torch_compile"), (
        "importing torch._inductor writes its /tmp default into TORCHINDUCTOR_CACHE_DIR; taken for the user's "
        f"choice, the compiled pieces land in /tmp and a restart recompiles: {r.stdout}")
    r = _run(code, XDG_CACHE_HOME=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "mine"))
    assert r.stdout.split()[-1] == str(tmp_path / "mine"), f"the user's TORCHINDUCTOR_CACHE_DIR was overridden: {r.stdout}"
