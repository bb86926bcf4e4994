"""The engine core's supervision, on the client's side: the threads that read its
outputs and watch its process, and the orderly shutdown.

vLLM counterpart: `vllm/v1/engine/utils.py` (process launch and monitoring for
the core engines) and the helpers of `vllm/v1/engine/core_client.py`.

Invariants:
- the receiver thread is the only reader of the output socket, and it holds
  the client weakly, so that a client dropped by garbage collection still
  shuts its core down (`close_core` runs from `weakref.finalize`);
- a core process that exits without a word (SIGKILL, the OOM killer) is
  reported by `monitor_core_process`, after the receiver has had the chance to
  deliver a DEAD message naming the cause;
- `close_core` is idempotent and ends with no core process left.
"""
from __future__ import annotations

import logging
import threading

import zmq

from mini_vllm.engine import EngineCoreOutputs, EngineCoreOutputType, EngineCoreRequestType, UtilityOutput
from mini_vllm.engine.core_proc import EngineCoreProc, report_dead
from mini_vllm.engine.exceptions import EngineDeadError
from mini_vllm.serial_utils import MsgpackDecoder

logger = logging.getLogger("mini_vllm")


def close_core(proc, threads: list, stop: threading.Event, sock, ctx) -> None:
    """Stop the core, then the client's threads, then release the sockets (also run
    by `weakref.finalize`); `threads`: the core's thread (in_thread) and the receiver."""
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


def monitor_core_process(client_ref, proc, stop: threading.Event, receiver: threading.Thread) -> None:
    """The process may die without a word (SIGKILL, the OOM killer)."""
    from multiprocessing.connection import wait

    wait([proc.sentinel])
    proc.join(5)  # reap it: the exit status is known only then
    # A core that died of an error sent DEAD with the cause before it exited: let the
    # receiver deliver it (it stops after DEAD) rather than report a bare exit status.
    receiver.join(2.0)
    client = client_ref()
    if client is not None and not stop.is_set():
        client._died(EngineDeadError(f"the engine core process (pid {proc.pid}) exited with status "
                                     f"{proc.exitcode}"))
