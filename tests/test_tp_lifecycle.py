"""Tensor-parallel worker processes: start, stop, across a torchrun-style
rendezvous (failures: test_tp_failures.py).

`LLM.shutdown()` and garbage collection of the engine must leave no worker
process and free the rendezvous port. The multi-machine path
(MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE) runs here on loopback with a
rank started as `python -m mini_vllm.executor.multiproc_executor`.
"""
from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time

import pytest

from engine_utils import make_llm, run_greedy
from tp_utils import wait_no_tp_children

PROMPTS = [[11, 12, 13, 14, 15] * 4, [200, 300, 400]]


def _port_is_free(port: int) -> bool:
    """True when nobody listens on `port` (SO_REUSEADDR: closed connections in
    TIME_WAIT do not count, as for any server that rebinds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_shutdown_stops_workers_frees_the_port_and_is_idempotent():
    llm = make_llm(tensor_parallel_size=2)
    ex = llm.llm_engine.engine_core.engine_core.executor
    procs, port = list(ex.procs), ex.port
    assert len(procs) == 1 and procs[0].is_alive()
    assert not _port_is_free(port), "the rendezvous store should listen while the engine runs"
    llm.shutdown()
    llm.shutdown()  # a second call is a no-op
    assert not procs[0].is_alive() and procs[0].exitcode == 0, \
        f"worker did not leave its loop cleanly (exit code {procs[0].exitcode})"
    assert _port_is_free(port), "the rendezvous port is still bound after shutdown"
    with pytest.raises(RuntimeError, match="shut down"):
        run_greedy(llm, PROMPTS[:1], 2)
    assert not wait_no_tp_children()


def test_garbage_collected_engine_stops_its_workers():
    llm = make_llm(tensor_parallel_size=2)
    procs = list(llm.llm_engine.engine_core.engine_core.executor.procs)
    del llm
    gc.collect()
    deadline = time.monotonic() + 20
    while procs[0].is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not procs[0].is_alive(), "worker outlived the garbage-collected engine"


def test_torchrun_style_environment_on_loopback(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    remote = subprocess.Popen([sys.executable, "-m", "mini_vllm.executor.multiproc_executor"],
                              env={**os.environ, **env, "RANK": "1", "OMP_NUM_THREADS": "1"})
    try:
        for k, v in {**env, "RANK": "0"}.items():
            monkeypatch.setenv(k, v)
        two = make_llm(tensor_parallel_size=2)
        for k in (*env, "RANK"):
            monkeypatch.delenv(k)
        assert two.llm_engine.engine_core.engine_core.executor.procs == [], "torchrun mode spawns no local worker"
        got = run_greedy(two, PROMPTS, 8)
        two.shutdown()
        assert remote.wait(timeout=30) == 0, "the remote rank must exit cleanly on shutdown"
    finally:
        if remote.poll() is None:
            remote.kill()
            remote.wait()
    assert got == run_greedy(make_llm(), PROMPTS, 8), "torchrun-style TP = 2 differs from TP = 1"
    assert _port_is_free(port), "MASTER_PORT still bound after shutdown"
