"""Mooncake Store as the KV pool (optional: not part of the default install).

vLLM counterpart: `mooncake_connector.py` and `vllm/distributed/mooncake_store.py`
(`MooncakeStoreConfig`, the `MooncakeDistributedStore` client). Mooncake
Store is the distributed DRAM/SSD pool of the Mooncake paper (FAST'25): a
master keeps object metadata, every client contributes a memory segment, and
values move by the transfer engine (RDMA, or TCP as here). A value may live
in the segment of the client that put it, so it vanishes with that process
(a standalone `mooncake_client` can own the pool instead).

Install: `pip install mooncake-transfer-engine-non-cuda` (it brings the
`mooncake_master` binary) and the system library `libibverbs1`, which the
binary links against even when it speaks TCP. `mooncake_available()` says
why it cannot run when either is missing, so tests skip with that reason.

Invariants: a missing key is a miss (the client returns empty bytes); a
negative return code is `StoreUnavailable`, never a silent hit.
"""
from __future__ import annotations

import ctypes.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from .store import KVStore, StoreUnavailable


def mooncake_available() -> str | None:
    """None when Mooncake can run here, else the reason it cannot."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"mooncake-transfer-engine-non-cuda is not installed ({e})"
    if ctypes.util.find_library("ibverbs") is None:
        return "the system library libibverbs1 is missing"
    if _master_binary() is None:
        return "the mooncake_master binary is not on PATH nor next to the Python executable"
    return None


def _master_binary() -> str | None:
    near = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return near if os.path.exists(near) else shutil.which("mooncake_master")


class MooncakeStore(KVStore):
    name = "mooncake"

    def __init__(self, master_address: str, metadata_server: str, segment_bytes: int = 256 << 20,
                 buffer_bytes: int = 64 << 20) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.client = MooncakeDistributedStore()
        rc = self.client.setup("127.0.0.1", metadata_server, int(segment_bytes), int(buffer_bytes),
                               "tcp", "", master_address)
        if rc != 0:
            raise StoreUnavailable(f"mooncake setup with master {master_address} failed (code {rc})")

    def batch_put(self, items) -> None:
        if items:
            rc = self.client.put_batch([k for k, _ in items], [bytes(v) for _, v in items])
            if rc != 0:
                raise StoreUnavailable(f"mooncake put_batch failed (code {rc})")

    def batch_get(self, keys):
        if not keys:
            return []
        return [v if v else None for v in self.client.get_batch(list(keys))]

    def batch_exists(self, keys):
        codes = self.client.batch_is_exist(list(keys)) if keys else []
        if any(c < 0 for c in codes):
            raise StoreUnavailable("mooncake batch_is_exist failed")
        return [c == 1 for c in codes]

    def close(self) -> None:
        self.client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeMasterProcess:
    """A local `mooncake_master` with its HTTP metadata server, stopped by PID."""

    def __init__(self) -> None:
        self.rpc_port, self.http_port = _free_port(), _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self, timeout_s: float = 15.0) -> "MooncakeMasterProcess":
        args = [_master_binary(), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited at start (code {self.proc.returncode})")
            try:
                for port in (self.rpc_port, self.http_port):
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("mooncake_master did not open its ports in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
