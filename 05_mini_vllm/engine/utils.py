"""The engine core's supervision, on the client's side: how its process starts,
the threads that read its outputs and watch its process, and the orderly
shutdown.

vLLM counterpart: `vllm/v1/engine/utils.py` (process launch and monitoring for
the core engines), the helpers of `vllm/v1/engine/core_client.py`, and
`vllm/utils/system_utils.py` (`get_mp_context`, `_maybe_force_spawn`).

Invariants:
- the receiver thread is the only reader of the output socket, and it holds
  the client weakly, so that a client dropped by garbage collection still
  shuts its core down (`close_core` runs from `weakref.finalize`);
- a core process that exits without a word (SIGKILL, the OOM killer) is
  noticed from its sentinel at once (`gone` is set, so that no send waits for
  it), and reported by `monitor_core_process` after at most DEAD_GRACE_S, the
  time the receiver gets to deliver a DEAD message naming the cause;
- `close_core` is idempotent and ends with no core process left and no socket
  file left;
- the core process is forked unless CUDA is initialised (vLLM's rule), spawned
  otherwise, and a main module that spawn cannot import is refused up front.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import tempfile
import threading

import zmq

from mini_vllm.engine import EngineCoreOutputs, EngineCoreOutputType, EngineCoreRequestType, UtilityOutput
from mini_vllm.engine.core_proc import EngineCoreProc, remove_socket_files, report_dead
from mini_vllm.engine.exceptions import EngineDeadError
from mini_vllm.serial_utils import MsgpackDecoder

logger = logging.getLogger("mini_vllm")
# How long a dead core's DEAD message (its cause) may still take to be read once its
# process has exited: the core flushes it before it exits, so it is already here.
DEAD_GRACE_S = 0.25
# A Unix socket's path must fit sockaddr_un.sun_path: 108 bytes with the terminating NUL.
SUN_PATH_MAX = 107
SHORT_SOCKET_DIR = "/tmp"


def ipc_socket_base(name: str) -> str:
    """The path prefix of the core's two ipc:// sockets (`<base>-in`, `<base>-out`): in the
    temporary directory (TMPDIR), unless that is too deep for a Unix socket's 107 bytes
    (a pytest tmp_path, a nested CI workspace), then in /tmp with a warning; where neither
    fits, an error naming TMPDIR, instead of ZeroMQ's "File name too long" from the core."""
    for folder in (tempfile.gettempdir(), SHORT_SOCKET_DIR):
        base = os.path.join(folder, name)
        if len(f"{base}-out".encode()) <= SUN_PATH_MAX and os.access(folder, os.W_OK):
            if folder == SHORT_SOCKET_DIR and folder != tempfile.gettempdir():
                logger.warning("the temporary directory %s is too deep for a Unix socket path (%d bytes at most); "
                               "the engine core's sockets go to %s", tempfile.gettempdir(), SUN_PATH_MAX, folder)
            return base
    raise ValueError(f"the engine core's socket path {os.path.join(tempfile.gettempdir(), name)}-out is longer than "
                     f"the {SUN_PATH_MAX} bytes a Unix socket takes, and {SHORT_SOCKET_DIR} is not writable: "
                     "set TMPDIR to a shorter directory")
MP_METHOD_ENV = "MINI_VLLM_WORKER_MULTIPROC_METHOD"
_MP_METHODS = ("fork", "spawn", "forkserver")


def _fork_hazard() -> str | None:
    """Why forking this process now would break the child, or None (vLLM's
    `_maybe_force_spawn`): the CUDA driver cannot be used in a child forked after
    it was initialised; and numba's OpenMP thread pool, once started, terminates a
    forked child at its first parallel loop ("fork() called from a process already
    using GNU OpenMP"), which kills a core that runs numba kernels on 2+ threads. (torch's
    own OpenMP pool, which a fork also leaves behind, is handled in the child:
    `core_proc.run_engine_core` runs the core in a new thread.)"""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    if "numba" in sys.modules:
        import numba
        from numba.np.ufunc import parallel

        if parallel._is_initialized and numba.threading_layer() == "omp":
            return "numba's OpenMP thread pool runs in this process"
    return None


def get_mp_context() -> multiprocessing.context.BaseContext:
    """The start method of the engine core process (vLLM's `get_mp_context`).

    MINI_VLLM_WORKER_MULTIPROC_METHOD chooses (fork, spawn or forkserver); unset,
    fork on Linux unless CUDA is initialised (start-up then skips re-importing
    torch and the main module), spawn otherwise (macOS: fork is unsafe there). An
    explicit fork after CUDA was initialised becomes spawn, with a warning, as in
    vLLM."""
    method = os.environ.get(MP_METHOD_ENV)
    if method is not None and method not in _MP_METHODS:
        raise ValueError(f"{MP_METHOD_ENV} must be one of {list(_MP_METHODS)}, got {method!r}")
    hazard = _fork_hazard() if method in (None, "fork") else None
    if method is None:
        method = "fork" if sys.platform == "linux" and hazard is None else "spawn"
        if hazard is not None:
            logger.info("starting the engine core with spawn, not fork: %s", hazard)
    elif method == "fork" and hazard is not None:
        logger.warning("%s=fork overridden with spawn: %s", MP_METHOD_ENV, hazard)
        method = "spawn"
    if method != "fork":
        check_main_importable(method)
    return multiprocessing.get_context(method)


def check_main_importable(method: str) -> None:
    """spawn (and forkserver) run the main module again in the child: refuse, with
    the fix, a main module that cannot be found again (a script read from stdin)."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main.__spec__, "name", None) is not None:
        return  # `python -m pkg.mod`: the child imports it by name
    path = getattr(main, "__file__", None)
    if path is None or os.path.isfile(path):
        return  # an interactive session or `python -c` (nothing to re-run), or a file
    raise RuntimeError(
        f"the engine core process would be started with {method}, which imports the main module again, and "
        f"the main module {path!r} is not a file it can import (a script read from stdin?). Save the script "
        f"to a file and put the code that builds the engine under `if __name__ == \"__main__\":`, or set "
        f"{MP_METHOD_ENV}=fork")


def spawn_hint(method: str) -> str:
    """What to check when a core started with `method` died before it was ready."""
    main = sys.modules.get("__main__")
    if method == "fork" or getattr(main, "__file__", None) is None:
        return ""
    return (f"; it was started with {method}, which imports the main module ({main.__file__}) again: code "
            "that builds an engine must sit under `if __name__ == \"__main__\":`")


def close_core(proc, threads: list, stop: threading.Event, sock, ctx, socket_files=()) -> None:
    """Stop the core, then the client's threads, then release the sockets and remove
    their files (also run by `weakref.finalize`, so at exit too); `threads`: the
    core's thread (in_thread) and the receiver."""
    if stop.is_set():
        return
    stop.set()
    try:
        sock.send_multipart([EngineCoreRequestType.SHUTDOWN.value, b""], flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        pass  # no core is reading: it is gone already
    if proc is not None:
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    for t in threads:
        if t is not threading.current_thread():
            t.join(10)
    sock.close(linger=0)
    ctx.destroy(linger=0)
    remove_socket_files(socket_files)


def run_core_thread(box: list, config, in_addr, out_addr, ctx, executor_class) -> None:
    """The in_thread core: the process body without the process."""
    core = None
    try:
        core = EngineCoreProc(config, in_addr, out_addr, ctx, executor_class)
        box.append(core)
        core.run_busy_loop()
    except BaseException as e:  # noqa: BLE001
        logger.exception("engine core thread died: %r", e)
        report_dead(core, ctx, out_addr, e)
    finally:
        if core is not None:
            core.close()


def receive_outputs(client_ref, sock, stop: threading.Event) -> None:
    """The receiver thread. It holds the client only weakly, so that dropping the
    client (garbage collection) still shuts the core down."""
    outputs, utility, text = MsgpackDecoder(EngineCoreOutputs), MsgpackDecoder(UtilityOutput), MsgpackDecoder(str)
    try:
        while not stop.is_set():
            if not sock.poll(100):
                if client_ref() is None:
                    return
                continue
            kind, data = sock.recv_multipart(copy=False)
            client = client_ref()
            if client is None:
                return
            kind = kind.bytes
            if kind == EngineCoreOutputType.OUTPUTS.value:
                client._deliver(outputs.decode(data.buffer))
            elif kind == EngineCoreOutputType.UTILITY.value:
                out = utility.decode(data.buffer)
                fut = client._pending.pop(out.call_id, None)
                if fut is not None:
                    if out.failure is None:
                        fut.set_result(out.result)
                    else:
                        fut.set_exception(RuntimeError(f"engine core utility call failed: {out.failure}"))
            elif kind == EngineCoreOutputType.DEAD.value:
                client._died(EngineDeadError(f"engine core died: {text.decode(data.buffer)}"))
                return
            del client
    finally:
        sock.close(linger=0)


def monitor_core_process(client_ref, proc, stop: threading.Event, receiver: threading.Thread,
                         gone: threading.Event) -> None:
    """The process may die without a word (SIGKILL, the OOM killer): its sentinel
    says so at once. `gone` is set first, so that no send waits for a dead core."""
    from multiprocessing.connection import wait

    wait([proc.sentinel])
    gone.set()
    # A core that died of an error sent DEAD with the cause before it exited: let the
    # receiver deliver it (it stops after DEAD) rather than report a bare exit status.
    receiver.join(DEAD_GRACE_S)
    proc.join(1)  # reaps it (it has exited: at once); the exit status is known only then
    client = client_ref()
    if client is not None and not stop.is_set():
        client._died(EngineDeadError(f"the engine core process (pid {proc.pid}) exited with status "
                                     f"{proc.exitcode}"))
