"""How the front end reaches the engine core: in-process, or over ZeroMQ.

vLLM counterpart: `vllm/v1/engine/core_client.py` (`EngineCoreClient.make_client`,
`InprocClient`, `MPClient`, `SyncMPClient`, `AsyncMPClient`).

- `InprocClient`: the core is an object in this process, and `get_output()`
  runs one step (vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING=0`; here
  `MINI_VLLM_ENABLE_V1_MULTIPROCESSING=0`). Readable, debuggable, no overlap.
- `SyncMPClient` (`LLM`, `LLMEngine`) and `AsyncMPClient` (`AsyncLLM`, the
  server): the core is an `EngineCoreProc` in its own process (forked unless
  CUDA is initialised, else spawned: `utils.get_mp_context`), or in
  a thread of this one (`in_thread=True`, the in-process mode of `AsyncLLM`),
  reached over two ZeroMQ PUSH/PULL pipes carrying msgpack (`serial_utils`).

Invariants of the MP clients:
- the constructor returns once the core has sent READY (its KV cache exists),
  or raises `EngineDeadError` with the core's error if it failed to start;
- messages go out in call order on one socket, used only by the caller's
  thread (sync: the user's; async: the event loop); a receiver thread alone
  reads the output socket and hands outputs over;
- if the core dies (DEAD message, or its process exits: SIGKILL included),
  `get_output` and every pending or later call raise `EngineDeadError`;
  nothing waits forever: a send never blocks (a dead core's process sentinel
  ends it at once, and SEND_TIMEOUT_S bounds it in all), and aborts sent to a
  dead core are dropped;
- `shutdown()` (also on garbage collection and at exit) stops the core and
  leaves no process behind.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import queue
import threading
import time
import uuid
import weakref

import zmq

from mini_vllm.engine import (EngineCoreOutputs, EngineCoreOutputType, EngineCoreReady, EngineCoreRequest,
                              EngineCoreRequestType)
from mini_vllm.engine.core import UTILITY_METHODS, EngineCore
from mini_vllm.engine.core_proc import EngineCoreProc, run_engine_core
from mini_vllm.engine.exceptions import EngineDeadError
from mini_vllm.engine.utils import (close_core, get_mp_context, ipc_socket_base, monitor_core_process,
                                    receive_outputs, run_core_thread, spawn_hint)
from mini_vllm.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("mini_vllm")
# A send that finds no core connected gives up after this long in all (a dead core is
# seen at once, from its sentinel; this bounds only a core alive but disconnected).
SEND_TIMEOUT_S = 5.0
_SEND_POLL_MS = 50


class InprocClient:
    """The core in this process; one `get_output()` is one step. `engine_core` is
    the `EngineCore` itself, for notebooks and tests that look inside."""

    def __init__(self, config, executor_class=None) -> None:
        self.engine_core = EngineCore(config, executor_class)
        self.ready = self.engine_core.ready_info()
        self._encoder, self._plain = MsgpackEncoder(), MsgpackDecoder()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        core = self.engine_core
        if core.batch_queue is None:
            return core.step()
        while True:  # asynchronous scheduling: until a batch's outputs are back
            out = core.step_with_batch_queue()
            if out is not None:
                return out
            if not core.batch_queue and not core.scheduler.has_unfinished_requests():
                return EngineCoreOutputs(scheduler_stats=core.make_stats())

    def call_utility(self, method: str, *args):
        """The same allowed methods, and the same answer types (plain msgpack values:
        a dataclass comes back as a dict) as from a core in its own process."""
        if method not in UTILITY_METHODS:
            raise RuntimeError(f"engine core utility call failed: {method!r} is not a utility method; "
                               f"allowed: {sorted(UTILITY_METHODS)}")
        return self._plain.decode(self._encoder.encode(getattr(self.engine_core, method)(*args)))

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class MPClient:
    """Starts an `EngineCoreProc` and speaks its protocol; subclasses decide how
    outputs reach the caller (`_deliver`)."""

    def __init__(self, config, executor_class=None, in_thread: bool = False) -> None:
        name = f"mini-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._socket_files: list[str] = []  # ipc:// paths, removed at shutdown (ZeroMQ leaves them)
        if in_thread:
            in_addr, out_addr = f"inproc://{name}-in", f"inproc://{name}-out"
        else:
            base = ipc_socket_base(name)
            self._socket_files = [f"{base}-in", f"{base}-out"]
            in_addr, out_addr = f"ipc://{base}-in", f"ipc://{base}-out"
        self.encoder = MsgpackEncoder()
        self._ids = itertools.count()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._dead: EngineDeadError | None = None
        self._dead_lock = threading.Lock()  # the receiver and the monitor may both report a death
        self._stop = threading.Event()
        self._core_gone = threading.Event()  # the core's process has exited (set from its sentinel)
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.start_method: str | None = None  # fork or spawn, for a core in its own process
        self._core_box: list[EngineCoreProc] = []  # in_thread: the core, once built
        self._core_thread: threading.Thread | None = None
        if not in_thread:
            # Before ZeroMQ starts its I/O threads, which a forked child would not have (with
            # their locks held for ever). The core connects to addresses nobody binds yet;
            # ZeroMQ retries until we do.
            import torch

            mp_ctx = get_mp_context()
            self.start_method = mp_ctx.get_start_method()
            self.proc = mp_ctx.Process(
                target=run_engine_core, name="EngineCore", kwargs=dict(
                    config=config, input_address=in_addr, output_address=out_addr,
                    executor_class=executor_class, num_threads=torch.get_num_threads(),
                    log_level=logging.getLogger().getEffectiveLevel(), parent_pid=os.getpid()))
            self.proc.start()
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)  # never block the caller on a busy core
        self.input_socket.bind(in_addr)
        out_sock = self.ctx.socket(zmq.PULL)
        out_sock.setsockopt(zmq.RCVHWM, 0)
        out_sock.bind(out_addr)
        # What a send that finds no core connected waits on: room on the socket, or the
        # core process's exit (its sentinel, a file descriptor ZeroMQ can poll).
        self._send_poller = zmq.Poller()
        self._send_poller.register(self.input_socket, zmq.POLLOUT)
        if self.proc is not None:
            self._send_poller.register(self.proc.sentinel, zmq.POLLIN)
        if in_thread:
            self._core_thread = threading.Thread(target=run_core_thread, name="EngineCore", daemon=True,
                                                 args=(self._core_box, config, in_addr, out_addr, self.ctx,
                                                       executor_class))
            self._core_thread.start()
        self._threads = [] if self._core_thread is None else [self._core_thread]
        self._finalizer = weakref.finalize(self, close_core, self.proc, self._threads, self._stop,
                                           self.input_socket, self.ctx, self._socket_files)
        try:
            self.ready: EngineCoreReady = self._handshake(out_sock)
        except BaseException:
            out_sock.close(linger=0)
            self.shutdown()
            raise
        me = weakref.ref(self)
        self._receiver = threading.Thread(target=receive_outputs, args=(me, out_sock, self._stop),
                                          name="EngineCoreClientOutput", daemon=True)
        self._threads.append(self._receiver)
        self._receiver.start()
        if self.proc is not None:
            threading.Thread(target=monitor_core_process, name="EngineCoreMonitor", daemon=True,
                             args=(me, self.proc, self._stop, self._receiver, self._core_gone)).start()

    # --------------------------------------------------------------- startup
    def _handshake(self, sock) -> EngineCoreReady:
        """Wait for READY (loading a model takes a while: no timeout, but a core that
        exits or reports DEAD ends the wait)."""
        while not sock.poll(200):
            if self.proc is not None and not self.proc.is_alive():
                raise EngineDeadError(f"the engine core process exited with status {self.proc.exitcode} "
                                      f"before it was ready (see its log above){spawn_hint(self.start_method)}")
        kind, data = sock.recv_multipart()
        if kind == EngineCoreOutputType.DEAD.value:
            raise EngineDeadError(f"the engine core failed to start: {MsgpackDecoder(str).decode(data)}")
        return MsgpackDecoder(EngineCoreReady).decode(data)

    @property
    def engine_core(self) -> EngineCoreProc | None:
        """The core object when it runs in a thread of this process (else None)."""
        return self._core_box[0] if self._core_box else None

    def _died(self, err: EngineDeadError) -> None:
        with self._dead_lock:
            if self._dead is not None:
                return
            self._dead = err
        logger.error("%s", err)
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._deliver(err)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------- calls
    @property
    def is_alive(self) -> bool:
        return self._dead is None and not self._stop.is_set() and not self._core_gone.is_set()

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._stop.is_set():
            raise EngineDeadError("the engine core was shut down")
        if self._core_gone.is_set():  # the monitor reports it (with the cause) within DEAD_GRACE_S
            raise EngineDeadError(f"the engine core process (pid {self.proc.pid}) has exited")

    def _send(self, kind: EngineCoreRequestType, payload) -> None:
        """Send one message, or raise `EngineDeadError`: never wait for ever.

        The pipe has no high-water mark, so a send can only fail to go out while no
        core is connected, and after READY that means the core is gone or going: a
        blocking send would then wait for ever, with the event loop's thread inside
        it. So: a non-blocking send; if it cannot go, a poll on the socket and on the
        core process's sentinel, bounded by SEND_TIMEOUT_S in all."""
        self._check_usable()
        frames = [kind.value, self.encoder.encode(payload)]
        deadline = time.monotonic() + SEND_TIMEOUT_S
        while True:
            try:
                self.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            events = dict(self._send_poller.poll(_SEND_POLL_MS))
            if self.proc is not None and self.proc.sentinel in events:
                self._core_gone.set()
            if self._core_thread is not None and not self._core_thread.is_alive():
                self._died(EngineDeadError("the engine core thread has exited"))
            self._check_usable()
            if time.monotonic() > deadline:  # alive but not connected: nothing sent can arrive
                self._died(EngineDeadError(f"the engine core took no message for {SEND_TIMEOUT_S} s "
                                           "(its input socket is not connected)"))
                self._check_usable()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Aborts to a dead core are dropped: its requests died with it (and a caller
        cleaning up after a client that went away must not fail)."""
        if not request_ids:
            return
        try:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))
        except EngineDeadError:
            pass

    def _call(self, method: str, args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        self._pending[call_id] = fut
        try:
            self._send(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        except BaseException:
            self._pending.pop(call_id, None)
            raise
        return fut

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(MPClient):
    """For `LLMEngine`: `get_output()` blocks until the core's next step arrives."""

    def __init__(self, config, executor_class=None, in_thread: bool = False) -> None:
        self.outputs_queue: queue.Queue = queue.Queue()
        super().__init__(config, executor_class, in_thread)

    def _deliver(self, item) -> None:
        self.outputs_queue.put(item)

    def get_output(self) -> EngineCoreOutputs:
        item = self.outputs_queue.get()
        if isinstance(item, BaseException):
            self.outputs_queue.put(item)  # every later call fails the same way
            raise item
        return item

    def call_utility(self, method: str, *args):
        return self._call(method, args).result()


class AsyncMPClient(MPClient):
    """For `AsyncLLM`: the same protocol, awaited on one event loop."""

    def __init__(self, config, executor_class=None, in_thread: bool = False) -> None:
        self._raw: queue.Queue = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        super().__init__(config, executor_class, in_thread)

    def _deliver(self, item) -> None:  # receiver thread
        self._raw.put(item)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

    async def get_output_async(self) -> EngineCoreOutputs:
        if self._loop is None:
            self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while True:
            try:
                item = self._raw.get_nowait()
                break
            except queue.Empty:
                self._wake.clear()
                if self._raw.empty():  # checked after the clear: a wake-up cannot be lost
                    await self._wake.wait()
        if isinstance(item, BaseException):
            self._raw.put(item)
            raise item
        return item

    async def call_utility_async(self, method: str, *args):
        return await asyncio.wrap_future(self._call(method, args))
