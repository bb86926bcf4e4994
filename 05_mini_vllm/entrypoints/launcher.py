"""Serving the app with uvicorn, and the two ways a server ends: a signal, or the
death of its engine.

vLLM counterpart: `vllm/entrypoints/launcher.py` (`serve_http`,
`terminate_if_errored`, the engine-death watchdog).

Invariants:
- SIGINT/SIGTERM: no new connection is accepted; the requests in flight have
  `grace_s` (`--timeout-graceful-shutdown`) to finish; every one still running
  then is answered, 503 in OpenAI's error shape or, in a stream, an error event
  and `data: [DONE]`, instead of being cancelled by uvicorn (a plain-text 500,
  a stream cut without [DONE], and a traceback in the log for each). The
  process then exits with 0.
- The engine's death: every request in flight has already been failed with a
  503 (by `AsyncLLM`); the server goes on answering new ones with 503 (and
  /health with 503) until none has arrived for DRAIN_QUIET_S (at most
  DRAIN_MAX_S), then shuts down as after a signal and exits with 1. Closing
  the listening socket resets the connections the kernel has accepted but the
  server has not read yet; waiting for a quiet moment first answers the
  clients that came just after the death instead of resetting them.
"""
from __future__ import annotations

import asyncio
import logging

import uvicorn

from mini_vllm.engine.exceptions import EngineDeadError

logger = logging.getLogger("mini_vllm")
ANSWER_S = 2.0  # after the grace period: how long the 503s get to be sent
DRAIN_QUIET_S = 0.2
DRAIN_MAX_S = 2.0


class ApiServer(uvicorn.Server):
    """uvicorn's server with the shutdown above; `engine` is the `AsyncLLM`."""

    def __init__(self, config: uvicorn.Config, engine, grace_s: float | None) -> None:
        # uvicorn waits grace_s + ANSWER_S before it cancels: by then every request has
        # been answered by `_answer_in_flight`, so it cancels nothing.
        config.timeout_graceful_shutdown = None if grace_s is None else grace_s + ANSWER_S
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self.exit_code = 0
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        # uvicorn re-raises the signal after a graceful shutdown, which would make the
        # exit status 128 + signum; a drained server has done its job and exits 0.
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        answer = asyncio.create_task(self._answer_in_flight())
        try:
            await super().shutdown(sockets)
        finally:
            answer.cancel()

    async def _answer_in_flight(self) -> None:
        if self.grace_s is None:
            return  # no limit: uvicorn waits for every request to finish
        await asyncio.sleep(self.grace_s)
        n = self.engine.fail_requests(EngineDeadError(
            f"the server is shutting down: the request did not finish within the graceful-shutdown period "
            f"({self.grace_s:g} s)"))
        if n:
            logger.warning("shutdown: %d request(s) still running after %g s answered with 503", n, self.grace_s)

    def engine_dead(self, exc: BaseException) -> None:
        """The engine's `on_dead` (on the event loop): drain, then exit with 1."""
        self.exit_code = 1
        logger.error("engine died (%r): shutting the server down so that a supervisor restarts it", exc)
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        loop, state = asyncio.get_running_loop(), self.server_state
        seen = (state.total_requests, len(state.connections))
        start = quiet_since = loop.time()
        while loop.time() - start < DRAIN_MAX_S and loop.time() - quiet_since < DRAIN_QUIET_S:
            await asyncio.sleep(0.05)
            now = (state.total_requests, len(state.connections))
            if now != seen:
                seen, quiet_since = now, loop.time()
        self.should_exit = True  # uvicorn's own shutdown, as after SIGTERM
