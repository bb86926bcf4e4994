"""An asyncio front end over `LLMEngine`: one engine thread, one output stream per request.

vLLM counterpart: `vllm/v1/engine/async_llm.py` (`AsyncLLM.generate`, `abort`,
the output handler loop) and `vllm/v1/engine/output_processor.py`'s
`RequestOutputCollector`. vLLM runs the engine core in another process behind
ZeroMQ; here it runs in one background thread of the server process.

Invariants:
- `LLMEngine` is not thread-safe, so every engine call (add_request,
  abort_request, step, and anything passed to `run_on_engine`) runs on the
  engine thread. The event loop only puts commands in a queue and awaits
  their futures: it never waits for a forward pass.
- Each request owns an `asyncio.Queue`; the engine thread hands a step's
  outputs to the loop with one `call_soon_threadsafe` per step.
- A command is applied before the next `step()`, so `await abort(id)`
  returns with the request's KV blocks already back in the pool.
- `add_request` returns only once the engine accepted the request (or
  raised its ValueError), so a server can answer 400 before streaming. Its
  `RequestOutputStream` ends after the finished output; a consumer that
  stops early (a disconnected client, a cancelled task) aborts the request
  through `close()`, which `generate()` calls in its `finally`.
- If `step()` raises, the engine is dead: every stream and every later call
  raises `EngineDeadError` instead of hanging, and `on_dead(exc)` runs on the
  event loop (the server uses it to exit, so that a supervisor restarts it, as
  vLLM's API server does when its engine core dies).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import AsyncGenerator, Callable

from mini_vllm.engine.async_stream import ABORTED, EngineDeadError, RequestOutputStream
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.metrics.stats import StepStats
from mini_vllm.outputs import RequestOutput

logger = logging.getLogger("mini_vllm")

# Engine latency lists are trimmed past this length (a server runs for days);
# the Prometheus histograms have already counted every value.
_MAX_KEPT_SAMPLES = 100_000


class AsyncLLM:
    def __init__(self, engine: LLMEngine, stat_loggers=(),
                 on_dead: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_dead = on_dead  # called once, on the event loop, when the engine thread dies
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.stat_loggers = list(stat_loggers)
        self._cmds: queue.Queue = queue.Queue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopped = False
        m = engine.metrics
        self._cursor = [m.num_prompt_tokens, m.num_generation_tokens, len(m.ttfts), len(m.itls),
                        len(m.e2e_latencies), len(m.finished), len(m.iteration_tokens)]
        self._thread = threading.Thread(target=self._run, name="mini-vllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str, stat_loggers=(), on_dead=None, **engine_args) -> "AsyncLLM":
        return cls(LLMEngine.from_engine_args(str(model), **engine_args), stat_loggers, on_dead)

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    # ------------------------------------------------------------ public API
    async def add_request(self, request_id: str | None, prompt, sampling_params, *, priority: int = 0,
                          output_kind: str = "delta") -> RequestOutputStream:
        """Validate and add one request; returns its output stream.

        Raises ValueError (the engine's input checks) when the request is invalid;
        then nothing of it stays in the engine."""
        self._check_alive()
        self._bind_loop()
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._queues:
            raise ValueError(f"request_id {rid!r} is already in use")
        stream = RequestOutputStream(self, rid)
        self._queues[rid] = stream.queue  # registered before the add, so no output can be missed
        try:
            await self._submit(lambda e: e.add_request(rid, prompt, sampling_params, priority=priority,
                                                       output_kind=output_kind))
        except asyncio.CancelledError:
            stream.close()  # the add still runs on the engine thread: undo it
            raise
        except BaseException:
            self._queues.pop(rid, None)
            raise
        return stream

    async def generate(self, prompt, sampling_params, request_id: str | None = None, *,
                       priority: int = 0, output_kind: str = "delta") -> AsyncGenerator[RequestOutput, None]:
        """Add one request and yield its outputs until the finished one (vLLM's
        `AsyncLLM.generate`). An invalid request raises ValueError at the first
        `__anext__`; a consumer that stops early aborts the request."""
        stream = await self.add_request(request_id, prompt, sampling_params, priority=priority,
                                        output_kind=output_kind)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()  # a client that went away must not keep its blocks

    async def abort(self, request_ids) -> None:
        """Abort and wait until the engine has freed the requests' blocks; their
        streams then end without a finished output."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._bind_loop()
        await self._submit(lambda e: e.abort_request(ids))
        for rid in ids:
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(ABORTED)

    def abort_nowait(self, request_ids) -> None:
        """Abort without waiting (callable from a generator's finally)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._cmds.put((lambda e: e.abort_request(ids), None))

    async def run_on_engine(self, fn: Callable[[LLMEngine], object]):
        """Run fn(engine) on the engine thread between two steps; returns its result."""
        self._bind_loop()
        return await self._submit(fn)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, stop the engine thread and the engine's workers."""
        if self._stopped:
            return
        self._stopped = True
        self._cmds.put(("stop", None))
        self._thread.join(timeout)

    # -------------------------------------------------------------- internals
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine died: {self._dead!r}")
        if self._stopped:
            raise EngineDeadError("the engine was shut down")

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("an AsyncLLM serves one event loop; create it inside that loop's program")

    async def _submit(self, fn):
        self._check_alive()
        fut = self._loop.create_future()
        self._cmds.put((fn, fut))
        return await fut

    def _resolve(self, fut, result, exc) -> None:  # event loop thread
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _deliver(self, outs) -> None:  # event loop thread
        for out in outs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:  # event loop thread
        for q in list(self._queues.values()):
            q.put_nowait(exc)

    def _died(self, exc: BaseException) -> None:  # event loop thread
        dead = EngineDeadError(f"engine died: {exc!r}")
        self._fail_all(dead)
        if self.on_dead is not None:
            self.on_dead(exc)

    def _call_loop(self, fn, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call
                pass

    # ---------------------------------------------------------- engine thread
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                busy = eng.has_unfinished_requests()
                cmds = [] if busy else [self._cmds.get()]  # idle: sleep until a command comes
                while True:
                    try:
                        cmds.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                for fn, fut in cmds:
                    if fn == "stop":
                        self._stop_engine()
                        return
                    try:
                        result, exc = fn(eng), None
                    except Exception as e:  # a bad request: reported to its caller only
                        result, exc = None, e
                    if fut is not None:
                        self._call_loop(self._resolve, fut, result, exc)
                if eng.has_unfinished_requests():
                    outs = eng.step()
                    if outs:
                        self._call_loop(self._deliver, outs)
                self._record_stats()
        except BaseException as e:  # noqa: BLE001 - anything from step() kills the engine
            logger.exception("engine thread died: %r", e)
            self._dead = e
            self._call_loop(self._died, e)
            while True:  # fail the commands still queued, so no caller waits forever
                try:
                    _, fut = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if fut is not None:
                    self._call_loop(self._resolve, fut, None, EngineDeadError(repr(e)))

    def _stop_engine(self) -> None:
        eng = self.engine
        ids = list(eng.output_processor.request_states)
        if ids:
            logger.info("shutdown: aborting %d request(s) in flight", len(ids))
            eng.abort_request(ids)
        self._record_stats()
        eng.shutdown()  # worker processes of tensor parallelism, if any
        self._call_loop(self._fail_all, EngineDeadError("the engine was shut down"))

    def _record_stats(self) -> None:
        """Hand the loggers what the last step (or abort) changed."""
        m, c = self.engine.metrics, self._cursor
        st = None if not self.stat_loggers else StepStats(self.engine.engine_core.make_stats(), m.num_prompt_tokens - c[0],
                       m.num_generation_tokens - c[1], m.ttfts[c[2]:], m.itls[c[3]:], m.e2e_latencies[c[4]:],
                       m.finished[c[5]:], m.iteration_tokens[c[6]:])
        for lst in (m.ttfts, m.itls, m.e2e_latencies, m.queue_times, m.finished, m.iteration_tokens):
            if len(lst) > _MAX_KEPT_SAMPLES:
                del lst[:len(lst) // 2]
        self._cursor = [m.num_prompt_tokens, m.num_generation_tokens, len(m.ttfts), len(m.itls),
                        len(m.e2e_latencies), len(m.finished), len(m.iteration_tokens)]
        for sl in self.stat_loggers:
            sl.record(st)

