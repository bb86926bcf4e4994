"""Start `python -m mini_vllm serve` in a subprocess on a free 127.0.0.1 port,
wait for /health, and stop it by its PID. Shared by tests/test_server_*.py."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine_utils import target_path

SERVED_NAME = "tiny"
API_KEY = "sk-test-key"
# Renders the request's tools (vLLM hands them to the template with tool_choice "none").
TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
SERVER_KV = 16 << 20  # 16 MiB: ~200 blocks of 16 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`fault`: a fault planted in the engine (see fault_server.py), or None for the
    plain `python -m mini_vllm serve`; `env`: extra environment variables."""

    def __init__(self, *extra: str, startup_timeout: float = 90.0, model: str | None = None,
                 fault: str | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/mini_vllm_server_{self.port}.log"
        # The server runs its engine core in a process of its own, as deployed (the
        # test process itself defaults to an in-process core, see conftest.py).
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   MINI_VLLM_ENABLE_V1_MULTIPROCESSING="1", **(env or {}))
        env.pop("MINI_VLLM_API_KEY", None)
        launcher = ["-m", "mini_vllm"] if fault is None else [str(Path(__file__).with_name("fault_server.py"))]
        if fault is not None:
            env["MINI_VLLM_TEST_FAULT"] = fault
        cmd = [sys.executable, *launcher, "serve", model or target_path(), "--port", str(self.port),
               "--served-model-name", SERVED_NAME, "--device", "cpu", "--kv-cache-memory-bytes",
               str(SERVER_KV), "--chat-template", TEMPLATE, "--log-level", "warning", *extra]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {startup_timeout} s: {self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-3000:]

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics (parsed with prometheus_client), keyed by sample name."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if "le" not in s.labels}

    def finished(self) -> dict[str, float]:
        """Finished requests so far by finish reason (vllm:request_success_total)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {s.labels["finished_reason"]: s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == "vllm:request_success_total"}

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits; returns the last samples."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # only this server's PID
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


async def wait_running(http: httpx.AsyncClient, n: int) -> None:
    """Poll /metrics until at least n requests run (each poll answers at once; the 60 s
    limit is a hang guard)."""
    import asyncio

    for _ in range(600):
        text = (await http.get("/metrics")).text
        running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")]
        if running and float(running[0].split()[-1]) >= n:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{n} requests never ran together")


_shared: dict = {"server": None, "users": 0}


@pytest.fixture(scope="session")
def api_server():
    """One server for the API and error tests, with --api-key API_KEY.

    Each test module that imports this fixture gets its own session-scoped
    instance, so the process is shared through a reference count: started by
    the first module that asks, stopped when the last one is finalized."""
    if _shared["server"] is None:
        _shared["server"] = Server("--api-key", API_KEY)
    _shared["users"] += 1
    yield _shared["server"]
    _shared["users"] -= 1
    if _shared["users"] == 0:
        _shared["server"].stop()
        _shared["server"] = None


def child_processes(pid: int) -> dict[int, str]:
    """The live children of `pid` (from /proc): pid -> command line."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue  # it exited while we looked
    return out


def process_name(pid: int) -> str:
    """/proc/PID/comm: what the process calls itself (the engine core: "EngineCore")."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def leftover_processes(server_pid: int, core_pid: int, tries: int) -> dict[int, str]:
    """The server's child processes still alive once they and the core are gone, or after
    `tries` looks a tenth of a second apart ({} when all are gone): the resource tracker,
    if any, leaves only after its parent."""
    children: dict[int, str] = {}
    for _ in range(tries):
        children = {p: c for p, c in child_processes(server_pid).items() if pid_alive(p)}
        if not children and not pid_alive(core_pid):
            break
        time.sleep(0.1)
    return children


def engine_core_pid(server_pid: int) -> int:
    """The server's engine core process: the child named "EngineCore" (forked, its command
    line is the server's; spawned, it sits beside multiprocessing's resource tracker)."""
    cores = [p for p in child_processes(server_pid) if process_name(p) == "EngineCore"]
    assert len(cores) == 1, f"expected one engine core process under the server, found {child_processes(server_pid)}"
    return cores[0]


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has exited; only its entry waits for a wait()
