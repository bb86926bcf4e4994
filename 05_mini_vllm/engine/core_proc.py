"""The engine core in its own process: a busy loop between two socket threads.

vLLM counterpart: `vllm/v1/engine/core.py` (`EngineCoreProc`,
`run_engine_core`, `run_busy_loop`, `process_input_sockets`,
`process_output_sockets`).

`EngineCoreProc` wraps `EngineCore` in vLLM's execution model: a busy loop
that owns the scheduler and the executor, fed by an input thread (ZeroMQ
socket -> decode -> input queue) and drained by an output thread (output
queue -> encode -> socket), so that decoding, encoding and socket waits
overlap the forward pass instead of adding to it. The front end
(`core_client.py`) starts it in a process of its own, or, for in-process
async use, in a thread (the same loop and messages over ZeroMQ's inproc
transport).

Invariants:
- a message is applied between two steps, in the order it was sent: after
  an abort (or a finished request) the request's KV blocks are back in the
  pool before the next `schedule()`, and a utility call sent after an abort
  sees the abort applied;
- the loop steps only while the scheduler has unfinished requests (or
  batches in flight) and blocks on the input queue otherwise (an idle core
  uses no CPU);
- every synchronous step sends one `EngineCoreOutputs`, even with no tokens
  in it (a chunk of a prefill): the front end's `step()` is one core step;
- if a step raises, the core sends DEAD with the error and its process exits
  with status 1; it also exits when the front end's process is gone, and then
  removes the socket files the front end could not.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading

import zmq

from mini_vllm.engine import (EngineCoreOutputs, EngineCoreOutputType, EngineCoreRequest, EngineCoreRequestType,
                              UtilityOutput)
from mini_vllm.engine.core import UTILITY_METHODS, EngineCore
from mini_vllm.scheduler import EngineCoreOutput
from mini_vllm.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("mini_vllm")


class EngineCoreProc(EngineCore):
    """The engine core behind ZeroMQ: one busy loop, an input thread, an output thread.

    `input_address` / `output_address` are bound by the client; the core
    connects to both. `ctx` is the ZeroMQ context (the client's own when the
    core runs in one of its threads, over inproc://)."""

    def __init__(self, config, input_address: str, output_address: str, ctx: zmq.Context,
                 executor_class=None, parent_pid: int | None = None) -> None:
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.ctx, self.parent_pid = ctx, parent_pid
        self.output_address = output_address
        super().__init__(config, executor_class)
        self._stop = threading.Event()
        self._in_thread = threading.Thread(target=self.process_input_sockets, args=(input_address,),
                                           name="EngineCoreInput", daemon=True)
        self._out_thread = threading.Thread(target=self.process_output_sockets, args=(output_address,),
                                            name="EngineCoreOutput", daemon=True)
        self._in_thread.start()
        self._out_thread.start()

    def run_busy_loop(self) -> None:
        """Say READY, then: apply every message that has arrived, take one step; block while idle."""
        self.output_queue.put((EngineCoreOutputType.READY, self.ready_info()))
        while True:
            block = not self.scheduler.has_unfinished_requests() and not self.batch_queue
            aborted = False
            while True:
                try:
                    kind, payload = self.input_queue.get(block=block)
                except queue.Empty:
                    break
                block = False
                if kind == EngineCoreRequestType.SHUTDOWN:
                    return
                self._handle_client_request(kind, payload)
                aborted |= kind == EngineCoreRequestType.ABORT
            if self.scheduler.has_unfinished_requests() or self.batch_queue:
                out = self.step() if self.batch_queue is None else self.step_with_batch_queue()
                if out is not None:
                    self.output_queue.put((EngineCoreOutputType.OUTPUTS, out))
            elif aborted:
                # Aborts emptied the scheduler and no step will report it: send the
                # stats alone, so that the front end's gauges (running, waiting, KV
                # usage) do not keep showing the aborted requests.
                self.output_queue.put((EngineCoreOutputType.OUTPUTS,
                                       EngineCoreOutputs(scheduler_stats=self.make_stats())))

    def _handle_client_request(self, kind, payload) -> None:
        if kind == EngineCoreRequestType.ADD:
            try:
                self.add_request(payload)
            except ValueError as e:  # the front end checks first; this is the last guard
                logger.warning("engine core refused request %r: %s", payload.request_id, e)
                self.output_queue.put((EngineCoreOutputType.OUTPUTS, EngineCoreOutputs(
                    [EngineCoreOutput(payload.request_id, [], "abort")], self.make_stats())))
        elif kind == EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
        elif kind == EngineCoreRequestType.UTILITY:
            call_id, method, args = payload
            try:
                if method not in UTILITY_METHODS:
                    raise ValueError(f"{method!r} is not a utility method; allowed: {sorted(UTILITY_METHODS)}")
                out = UtilityOutput(call_id, getattr(self, method)(*args))
            except Exception as e:  # the caller gets the error; the core goes on
                out = UtilityOutput(call_id, failure=f"{type(e).__name__}: {e}")
            self.output_queue.put((EngineCoreOutputType.UTILITY, out))

    # ------------------------------------------------------------ socket threads
    def process_input_sockets(self, address: str) -> None:
        """Receive, decode and queue the client's messages (vLLM's input thread)."""
        decoders = {EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
                    EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
                    EngineCoreRequestType.UTILITY: MsgpackDecoder(tuple[int, str, list])}
        sock = self.ctx.socket(zmq.PULL)
        sock.connect(address)
        try:
            while not self._stop.is_set():
                if not sock.poll(1000):
                    if self.parent_pid is not None and os.getppid() != self.parent_pid:
                        logger.error("engine core: the front end (pid %d) is gone; exiting", self.parent_pid)
                        # It bound the sockets and would have removed their files at its exit.
                        remove_socket_files(a[len("ipc://"):] for a in (address, self.output_address)
                                            if a.startswith("ipc://"))
                        self.input_queue.put((EngineCoreRequestType.SHUTDOWN, None))
                        return
                    continue
                kind_b, data = sock.recv_multipart(copy=False)
                kind = EngineCoreRequestType(kind_b.bytes)
                payload = None if kind == EngineCoreRequestType.SHUTDOWN else decoders[kind].decode(data.buffer)
                self.input_queue.put((kind, payload))
                if kind == EngineCoreRequestType.SHUTDOWN:
                    return
        finally:
            sock.close(linger=0)

    def process_output_sockets(self, address: str) -> None:
        """Encode and send what the loop produced (vLLM's output thread); None stops it."""
        encoder = MsgpackEncoder()
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(address)
        try:
            while True:
                item = self.output_queue.get()
                if item is None:
                    return
                kind, obj = item
                sock.send_multipart([kind.value, encoder.encode(obj)], copy=False)
        finally:
            sock.close(linger=2000)  # what is queued (the DEAD message) still goes out

    def close(self) -> None:
        """Stop the socket threads (after flushing the outputs) and the executor."""
        self._stop.set()
        self.output_queue.put(None)
        self._out_thread.join(5)
        self._in_thread.join(5)
        self.shutdown()


def set_process_title(name: str) -> None:
    """Name this process (its /proc/PID/comm, shown by ps and top), as vLLM names its
    core "EngineCore": a forked core's command line is its parent's."""
    if sys.platform != "linux":
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass  # a name is a convenience


def run_engine_core(config, input_address: str, output_address: str, executor_class=None,
                    num_threads: int | None = None, log_level: int = logging.INFO,
                    parent_pid: int | None = None) -> None:
    """The core process's body (vLLM's `EngineCoreProc.run_engine_core`): build the
    core, run the busy loop until SHUTDOWN (or SIGTERM, or the front end's death),
    and exit with 0; on any error tell the front end (DEAD) and exit with 1.

    The core runs in a thread of its own, not in the main thread: a forked core's
    main thread carries the front end's OpenMP thread pool, whose threads do not
    exist in this process, so its first parallel op would wait for them for ever
    (GNU OpenMP has no fork handler); a new thread starts a pool of its own. The
    main thread only waits, and turns SIGTERM into a SHUTDOWN message."""
    set_process_title("EngineCore")
    # force: a forked core inherits the front end's handlers; its lines say [core].
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s [core]: %(message)s",
                        force=True)
    box: list[EngineCoreProc] = []  # the core, once built
    status = [0]

    def _on_term(signum, frame):
        if not box:
            os._exit(0)  # still loading: nothing to stop yet
        box[0].input_queue.put((EngineCoreRequestType.SHUTDOWN, None))  # after the step in progress

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C goes to the front end, which shuts us down
    loop = threading.Thread(target=_core_main, name="EngineCoreLoop", args=(
        box, status, config, input_address, output_address, executor_class, num_threads, parent_pid))
    loop.start()
    while loop.is_alive():
        loop.join(0.5)  # with a timeout, so that the main thread runs the signal handler
    os._exit(status[0])  # skip torch's interpreter teardown; nothing is left to flush


def _core_main(box: list, status: list, config, input_address, output_address, executor_class, num_threads,
               parent_pid) -> None:
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)  # the front end's choice, not torch's default
    ctx = zmq.Context()
    core = None
    try:
        core = EngineCoreProc(config, input_address, output_address, ctx, executor_class, parent_pid)
        box.append(core)
        core.run_busy_loop()
    except BaseException as e:  # noqa: BLE001 - whatever kills the loop kills the engine
        logger.exception("engine core died: %r", e)
        status[0] = 1
        report_dead(core, ctx, output_address, e)
    finally:
        if core is not None:
            core.close()
        # Not linger=0: that would drop a DEAD message still in the socket's queue, and
        # the front end would learn only an exit status instead of the cause.
        ctx.destroy(linger=2000)


def remove_socket_files(paths) -> None:
    """ZeroMQ leaves an ipc:// socket's file behind when the socket closes; the
    side that bound it removes it (or the core, when that side was killed)."""
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass  # already gone


def report_dead(core: EngineCoreProc | None, ctx: zmq.Context, output_address: str, exc: BaseException) -> None:
    """Tell the front end the core is dead: through the output thread when it runs
    (after the outputs already queued), else on a socket of its own."""
    msg = f"{type(exc).__name__}: {exc}"
    if core is not None:
        core.output_queue.put((EngineCoreOutputType.DEAD, msg))
        return
    sock = ctx.socket(zmq.PUSH)
    sock.connect(output_address)
    sock.send_multipart([EngineCoreOutputType.DEAD.value, MsgpackEncoder().encode(msg)])
    sock.close(linger=2000)
