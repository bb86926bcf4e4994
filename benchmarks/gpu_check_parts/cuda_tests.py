"""The tests that need a GPU to mean anything, run by pytest in a subprocess.

No vLLM counterpart file (vLLM's CI runs its kernel and model tests on GPU runners).

Selected: every test file that asks `torch.cuda.is_available()` (they run
on the GPU when there is one: the Triton kernels compiled, the `triton`
backend serving models, the regressions of Chapters 1 and 4), plus the
engine's asynchronous-scheduling tests (deferred outputs, pinned uploads and
tokens fed back on the device do real work only on CUDA), CUDA-graph
padding tests (real captures and replays there), parity and invariance
tests, which `tests/engine_utils.py` points at CUDA and the `triton`
backend through MINI_VLLM_TEST_DEVICE and MINI_VLLM_TEST_ATTENTION_BACKEND.
Deselected on CUDA: the parametrisations that ask for the "cpu" backend by
name (a CPU-only kernel; CUDA tensors are not its input). The verdict comes
from pytest's JUnit XML; the whole log is
kept next to the report.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_check_parts.environment import REPO

ENGINE_TESTS = ["tests/test_ch5_async_scheduling.py", "tests/test_ch5_cudagraph_padding.py",
                "tests/test_ch5_engine_parity.py", "tests/test_ch5_engine_invariance.py"]
# --small: one quick file, enough to run the subprocess, the plugin and the XML parsing.
SMALL_TESTS = ["tests/test_ch5_kv_budget.py"]
CUDA_DESELECT = "not cpu"  # pytest -k: test ids of the CPU-only backend carry "[cpu]"
FAILED_PREFIX = "GPU-CHECK FAILED "  # pytest_plugin's line for a failure, written as it happens


def cuda_test_files(tests_dir: Path = REPO / "tests") -> list[str]:
    """Test files that choose the GPU when there is one (conftest.py only sets up the interpreter)."""
    return sorted(f"tests/{p.name}" for p in tests_dir.glob("test_*.py")
                  if "torch.cuda.is_available()" in p.read_text())


def parse_junit(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            bad = case.find(tag)
            if bad is not None:
                msg = (bad.get("message") or "").strip().splitlines()
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": tag,
                               "message": msg[0][:300] if msg else ""})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def failures_in_log(text: str) -> list[dict]:
    """The failures `pytest_plugin` wrote to the log as they happened: the only record
    of them when an interrupted run left no JUnit XML."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith(FAILED_PREFIX):
            test, _, when = line[len(FAILED_PREFIX):].rpartition(" (")
            detail = [x.strip() for x in lines[i + 1:i + 40] if x.startswith("E ")]
            out.append({"test": test, "kind": when.rstrip(")"),
                        "message": (detail[0][1:].strip() if detail else "")[:300]})
    return out


def run(out_dir: Path, device: str, small: bool, timeout_s: float, engine_first: bool = False) -> dict:
    """pytest on the selected files; at `timeout_s` it is interrupted (SIGINT), so the
    JUnit XML still lists the tests that ran, and killed 20 s later if it hangs."""
    files = SMALL_TESTS if small else (ENGINE_TESTS + cuda_test_files() if engine_first
                                       else cuda_test_files() + ENGINE_TESTS)
    xml, log = out_dir / "cuda_tests.xml", out_dir / "cuda_tests.log"
    env = dict(os.environ, MINI_VLLM_TEST_DEVICE=device, MINI_VLLM_TEST_ATTENTION_BACKEND="triton",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO / "benchmarks")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "gpu_check_parts.pytest_plugin", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *(["-k", CUDA_DESELECT] if device == "cuda" else []), *files]
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # pytest stops and still writes the XML of what ran
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # pytest and anything it started
            except ProcessLookupError:  # it stopped on the interrupt, with its children
                pass
            proc.wait()
            rc = None
    result = {"files": files, "command": " ".join(cmd[1:]), "exit_code": rc, "timed_out": rc is None,
              "seconds": time.monotonic() - start, "log": log.name}
    if xml.exists():
        result.update(parse_junit(xml))
    else:
        failed = failures_in_log(log.read_text(errors="replace"))
        result.update(tests=0, failures=len(failed), errors=0, skipped=0, passed=0, failed=failed)
    result["ok"] = rc == 0 and result["tests"] > 0
    return result
