"""The output stream of one request of `AsyncLLM`, and the error of a dead engine.

vLLM counterparts: `RequestOutputCollector` in `vllm/v1/engine/output_processor.py`
(the error of a dead engine lives in `exceptions.py`, as in vLLM).

Invariants: a stream yields a request's outputs in order and ends right after
the finished one (or, silently, after an explicit abort); once ended it has
left the engine's table of queues; `close()` on an unfinished stream aborts
its request, so a consumer that walks away never leaves blocks behind.
"""
from __future__ import annotations

import asyncio

from mini_vllm.engine.exceptions import EngineDeadError
from mini_vllm.outputs import RequestOutput


ABORTED = object()  # ends the stream of a request aborted through `abort()`


class RequestOutputStream:
    """The outputs of one request, as an async iterator (vLLM's
    `RequestOutputCollector`). It ends after the finished output, or silently
    after `AsyncLLM.abort`; `close()` aborts the request unless it finished."""

    def __init__(self, llm, request_id: str) -> None:  # llm: AsyncLLM
        self.llm, self.request_id = llm, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> "RequestOutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        if out is ABORTED:
            self._end()
            raise StopAsyncIteration
        if isinstance(out, BaseException):
            self._end()
            if isinstance(out, EngineDeadError):
                raise out
            raise EngineDeadError(f"engine died: {out!r}") from out
        if out.finished:
            self._end()
        return out

    def _end(self) -> None:
        self.finished = True
        self.llm._queues.pop(self.request_id, None)

    def close(self) -> None:
        """Abort the request unless it finished; safe to call more than once."""
        if not self.finished and self.llm._dead is None:
            self.llm.abort_nowait(self.request_id)
        self._end()
