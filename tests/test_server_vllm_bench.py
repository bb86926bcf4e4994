"""vLLM's own benchmark client, `vllm bench serve`, against `python -m mini_vllm serve`: a real
client the course did not write must run unchanged (completions and chat backends, streamed
usage, prompts that leave less room than `max_tokens` in the context).

Needs `.venv-vllm` (`make vllm`); skipped with that reason without it. CI runs it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from vllm_side import MISSING, _env, vllm_python  # noqa: E402

from engine_utils import target_path  # noqa: E402
from server_utils import SERVED_NAME, Server  # noqa: E402

pytestmark = pytest.mark.skipif(vllm_python() is None, reason=MISSING)


@pytest.fixture(scope="module")
def server():
    s = Server("--max-num-seqs", "32", "--kv-cache-memory-bytes", str(64 << 20))
    yield s
    s.stop()


def bench(url: str, tmp_path: Path, *args: str) -> dict:
    cmd = [str(vllm_python().parent / "vllm"), "bench", "serve", "--base-url", url, "--model", SERVED_NAME,
           "--tokenizer", target_path(), "--dataset-name", "random", "--ignore-eos", "--seed", "0",
           "--disable-tqdm", "--request-rate", "inf", "--save-result", "--result-dir", str(tmp_path),
           "--result-filename", "result.json", *args]
    proc = subprocess.run(cmd, env=_env(1, in_process=False), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"vllm bench serve failed against the course's server:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_vllm_bench_serve_runs_unchanged(server, tmp_path, backend):
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    r = bench(server.url, tmp_path, "--backend", backend, "--endpoint", endpoint, "--num-prompts", "12",
              "--random-input-len", "64", "--random-output-len", "16")
    assert (r["completed"], r.get("failed", 0)) == (12, 0), f"{backend}: completed {r['completed']} of 12"
    assert r["total_output_tokens"] == 12 * 16, (
        f"{backend}: {r['total_output_tokens']} output tokens, want 192: ignore_eos or streamed usage is wrong")


def test_vllm_bench_serve_past_the_context(server, tmp_path):
    """Input 950 + output 128 on a 1,024-token context: vLLM serves such requests up to the
    context's end (finish_reason "length"); so must the course's server, for every request."""
    r = bench(server.url, tmp_path, "--backend", "openai", "--num-prompts", "6", "--random-input-len", "950",
              "--random-output-len", "128")
    assert (r["completed"], r.get("failed", 0)) == (6, 0), (
        f"completed {r['completed']} of 6: prompt + max_tokens past the context must be served up to the limit")
    assert 0 < r["total_output_tokens"] < 6 * 128, "outputs must stop at the context's end"
