"""An asyncio front end over the engine core: one output stream per request.

vLLM counterpart: `vllm/v1/engine/async_llm.py` (`AsyncLLM.generate`, `abort`,
`output_handler`) and `vllm/v1/engine/output_processor.py`'s
`RequestOutputCollector`. As in vLLM, the engine core (scheduler + executor)
runs in its own process behind an `AsyncMPClient`; this process only
validates and tokenizes requests, detokenizes outputs and serves HTTP, so
none of that waits for a forward pass or holds the interpreter lock a
forward pass needs. `MINI_VLLM_ENABLE_V1_MULTIPROCESSING=0` runs the same
core loop in a thread of this process instead (tests, notebooks).

Invariants:
- The front end (output processor, detokenizers, metrics) runs on the event
  loop's thread: one `output_handler` task turns each core step into outputs,
  and the event loop never waits for a step. Input processing (tokenizing,
  bad words, grammar compilation) runs in the one tokenizer thread
  (`run_in_tokenizer_thread`, vLLM's `_tokenizer_executor`): a 2 MB prompt
  takes seconds to tokenize, which would stall every stream; a single thread,
  since a fast tokenizer's encode must not run twice at once.
- Each request owns an `asyncio.Queue`; a request is registered before it is
  sent, so no output can be missed.
- Messages reach the core in call order: a request aborted (`abort`, or a
  stream closed early by a consumer that went away) is freed by the core
  before its next schedule, and a utility call sent after the abort sees its
  blocks back in the pool.
- `add_request` raises the processor's ValueError (naming the field) before
  anything is sent, so a server can answer 400 before streaming; nothing of
  the request stays behind.
- If the core dies (its step raised, or its process was killed), every stream
  and every later call raises `EngineDeadError` instead of hanging,
  `is_running` turns False and `on_dead(exc)` runs once, on the event loop
  (the server exits through it, so that a supervisor restarts it, as vLLM's
  API server does when its engine core dies).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncGenerator, Callable

from mini_vllm.config import EngineConfig
from mini_vllm.engine import multiprocessing_enabled
from mini_vllm.engine.async_stream import ABORTED, RequestOutputStream
from mini_vllm.engine.core_client import AsyncMPClient
from mini_vllm.engine.exceptions import EngineDeadError
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.metrics.stats import StepStats
from mini_vllm.models.checkpoint_checks import check_checkpoint
from mini_vllm.outputs import RequestOutput

logger = logging.getLogger("mini_vllm")

# Engine latency lists are trimmed past this length (a server runs for days);
# the Prometheus histograms have already counted every value.
_MAX_KEPT_SAMPLES = 100_000


class AsyncLLM:
    def __init__(self, engine: LLMEngine, stat_loggers=(),
                 on_dead: Callable[[BaseException], None] | None = None) -> None:
        """`engine`: the front end (processor, output processor, metrics) around an
        `AsyncMPClient`; `from_engine_args` builds it."""
        if not isinstance(engine.engine_core, AsyncMPClient):
            raise ValueError("AsyncLLM needs an LLMEngine built around an AsyncMPClient; "
                             "use AsyncLLM.from_engine_args")
        self.engine = engine
        self.engine_core: AsyncMPClient = engine.engine_core
        self.on_dead = on_dead  # called once, on the event loop, when the core dies
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.stat_loggers = list(stat_loggers)
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopped = False
        self.tokenizer_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mini-vllm-tokenizer")
        m = engine.metrics
        self._cursor = [m.num_prompt_tokens, m.num_generation_tokens, len(m.ttfts), len(m.itls),
                        len(m.e2e_latencies), len(m.finished), len(m.iteration_tokens)]

    @classmethod
    def from_engine_args(cls, model: str, stat_loggers=(), on_dead=None, **engine_args) -> "AsyncLLM":
        """`engine_args`: EngineConfig's fields, plus `tokenizer_obj`, `executor_class`
        and `multiprocess_mode` (None: MINI_VLLM_ENABLE_V1_MULTIPROCESSING, default on)."""
        tok = engine_args.pop("tokenizer_obj", None)
        executor_class = engine_args.pop("executor_class", None)
        mp = engine_args.pop("multiprocess_mode", None)
        mp = multiprocessing_enabled() if mp is None else mp
        config = EngineConfig.from_kwargs(str(model), **engine_args)
        check_checkpoint(config.model, config.quantization, config.dtype)  # vLLM's errors, before the core process starts
        client = AsyncMPClient(config, executor_class, in_thread=not mp)
        try:
            engine = LLMEngine(config, tok, executor_class, client=client)
        except BaseException:
            client.shutdown()
            raise
        return cls(engine, stat_loggers, on_dead)

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopped and self.engine_core.is_alive

    # ------------------------------------------------------------ public API
    async def start(self) -> None:
        """Start watching the core's outputs now (the server calls it at startup, so
        that a core that dies while idle still stops the server)."""
        self._bind_loop()

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
            request = await self.run_in_tokenizer_thread(self.engine.processor.process_inputs, rid, prompt,
                                                         sampling_params, None, priority)
            self._check_alive()  # the engine may have died while the prompt was tokenized
            self.engine.add_request(rid, request, None, priority=priority, output_kind=output_kind)
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
        """Abort requests: their streams end without a finished output, and the core
        frees their blocks before its next schedule."""
        self.abort_nowait(request_ids)

    def abort_nowait(self, request_ids) -> None:
        """`abort` without a coroutine (callable from a generator's finally)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        try:
            self.engine.abort_request(ids)
        except EngineDeadError:  # nothing to free in a dead core; forget the requests here
            self.engine.output_processor.abort_requests(ids)
        for rid in ids:
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(ABORTED)

    async def run_in_tokenizer_thread(self, fn, *args):
        """`fn(*args)` in the tokenizer thread, awaited: what tokenizes (or renders a
        chat template) off the event loop, one call at a time."""
        self._check_alive()
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_executor, fn, *args)

    async def call_utility(self, method: str, *args):
        """A read-only question to the core (`core.UTILITY_METHODS`), answered
        between two steps, after every message sent before it."""
        self._check_alive()
        return await self.engine_core.call_utility_async(method, *args)

    def shutdown(self) -> None:
        """Stop the core (its process, and the workers of tensor parallelism)."""
        if self._stopped:
            return
        self._stopped = True
        if self._output_task is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._output_task.cancel)
        self.tokenizer_executor.shutdown(wait=False, cancel_futures=True)
        self.engine_core.shutdown()
        self._fail_all(EngineDeadError("the engine was shut down"))

    # -------------------------------------------------------------- internals
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine died: {self._dead}")
        if self._stopped:
            raise EngineDeadError("the engine was shut down")

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._output_task = loop.create_task(self._output_handler(), name="mini-vllm-output-handler")
        elif self._loop is not loop:
            raise RuntimeError("an AsyncLLM serves one event loop; create it inside that loop's program")

    async def _output_handler(self) -> None:
        """One core step at a time: outputs to their streams, stats to the loggers."""
        eng = self.engine
        try:
            while True:
                res = await self.engine_core.get_output_async()
                for out in eng.process_engine_outputs(res):
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
                self._record_stats(res.scheduler_stats, res.spec_decoding_stats)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the core is gone: fail loudly, once
            if self._stopped:
                return
            logger.error("engine core died: %s", e)
            self._dead = e
            self._fail_all(e if isinstance(e, EngineDeadError) else EngineDeadError(f"engine died: {e!r}"))
            if self.on_dead is not None:
                self.on_dead(e)

    def fail_requests(self, exc: BaseException) -> int:
        """End every request in flight with `exc` (a server that shuts down answers
        them with it); returns how many. Their consumers' cleanup aborts them."""
        return self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> int:
        queues = list(self._queues.values())
        for q in queues:
            q.put_nowait(exc)
        return len(queues)

    def _record_stats(self, sched_stats, spec_stats) -> None:
        """Hand the loggers what the last step changed."""
        m, c = self.engine.metrics, self._cursor
        st = None if not self.stat_loggers else StepStats(sched_stats, m.num_prompt_tokens - c[0],
                       m.num_generation_tokens - c[1], m.ttfts[c[2]:], m.itls[c[3]:], m.e2e_latencies[c[4]:],
                       m.finished[c[5]:], m.iteration_tokens[c[6]:], spec_decoding_stats=spec_stats)
        for lst in (m.ttfts, m.itls, m.e2e_latencies, m.queue_times, m.finished, m.iteration_tokens):
            if len(lst) > _MAX_KEPT_SAMPLES:
                del lst[:len(lst) // 2]
        self._cursor = [m.num_prompt_tokens, m.num_generation_tokens, len(m.ttfts), len(m.itls),
                        len(m.e2e_latencies), len(m.finished), len(m.iteration_tokens)]
        for sl in self.stat_loggers:
            sl.record(st)
