"""The engine core: scheduler + executor, one step at a time, in-process or in its own process.

vLLM counterpart: `vllm/v1/engine/core.py` (`EngineCore.step`, `add_request`,
`abort_requests`; `EngineCoreProc` with `run_engine_core`,
`run_busy_loop`, `process_input_sockets`, `process_output_sockets`).

`EngineCore` is the step, readable end to end:

    schedule() -> execute_model(scheduler_output) -> update_from_output()

`EngineCoreProc` wraps it in vLLM's execution model: a busy loop that owns
the scheduler and the executor, fed by an input thread (ZeroMQ socket ->
decode -> input queue) and drained by an output thread (output queue ->
encode -> socket), so that decoding, encoding and socket waits overlap the
forward pass instead of adding to it. The front end (`core_client.py`)
starts it in a process of its own, or, for in-process async use, in a thread
(the same loop and messages over ZeroMQ's inproc transport).

Invariants:
- a message is applied between two steps, in the order it was sent: after
  an abort (or a finished request) the request's KV blocks are back in the
  pool before the next `schedule()`, and a utility call sent after an abort
  sees the abort applied;
- the loop steps only while the scheduler has unfinished requests and
  blocks on the input queue otherwise (an idle core uses no CPU);
- every step sends one `EngineCoreOutputs`, even with no tokens in it (a
  chunk of a prefill): the front end's `step()` is one core step;
- if a step raises, the core sends DEAD with the error and its process exits
  with status 1; it also exits when the front end's process is gone.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from pathlib import Path

import zmq

from mini_vllm.engine import (EngineCoreOutputs, EngineCoreOutputType, EngineCoreReady, EngineCoreRequest,
                              EngineCoreRequestType, UtilityOutput)
from mini_vllm.executor import get_executor_class
from mini_vllm.executor.abstract import Executor
from mini_vllm.metrics.stats import SchedulerStats
from mini_vllm.models.config import ModelConfig
from mini_vllm.scheduler import EngineCoreOutput, Request, RequestStatus, Scheduler
from mini_vllm.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("mini_vllm")

# What a client may call by name in the core (vLLM's utility calls): read-only
# views and the stats the front end cannot compute itself.
UTILITY_METHODS = frozenset({"spec_decoding_stats", "make_stats", "has_unfinished_requests",
                             "num_free_blocks", "num_free_cpu_blocks", "reset_prefix_cache"})


class EngineCore:
    """`executor_class` (vLLM's argument of the same name) defaults to the one
    the config asks for (`get_executor_class`); tools pass a subclass to watch
    or shape execution (Chapter 6's P/D engine process counts the tokens it
    computes this way)."""

    def __init__(self, config, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        # Chapter 6, imported only when asked for: the scheduler-side connector stays
        # here, its worker-side twin (same store, same counters) goes to the executor.
        self.kv_connector = self.kv_connector_worker = None
        if config.kv_transfer_config is not None:
            from mini_vllm.global_cache.factory import build_connectors
            model_config = ModelConfig.from_json(Path(config.model) / "config.json")
            self.kv_connector, self.kv_connector_worker = build_connectors(config, model_config)
        executor_class = executor_class or get_executor_class(config)
        self.executor = executor_class(config, kv_connector=self.kv_connector_worker)
        self.model_config = self.executor.model_config
        self.max_model_len = self.executor.max_model_len
        budget_probe = config.scheduler_config(self.max_model_len, 0)
        n_gpu, n_cpu = self.executor.determine_num_blocks(budget_probe.max_num_batched_tokens)
        self.num_gpu_blocks, self.num_cpu_blocks = n_gpu, n_cpu
        self.executor.initialize_cache(n_gpu, n_cpu, config.max_num_seqs)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB), swap space: %d blocks", n_gpu,
                    config.block_size, n_gpu * self.executor.bytes_per_block / 2**20, n_cpu)
        self.scheduler = Scheduler(config.scheduler_config(self.max_model_len, n_cpu), n_gpu,
                                   config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                   connector=self.kv_connector)
        self._seen: set[str] = set()
        # Asynchronous scheduling: (future, SchedulerOutput, prompt tokens, stamps) of the
        # batches submitted and not yet updated from; None when every step is synchronous.
        self.batch_queue: collections.deque | None = collections.deque() if config.async_scheduling else None
        self.batch_queue_size = 2

    def ready_info(self) -> EngineCoreReady:
        """The facts the front end validates requests against (the handshake)."""
        return EngineCoreReady(self.max_model_len, self.num_gpu_blocks, self.num_cpu_blocks,
                               self.config.block_size, os.getpid())

    def add_request(self, request: EngineCoreRequest) -> None:
        """Turn the front end's validated request into the scheduler's `Request`
        (vLLM's `EngineCore.add_request` after `preprocess_add_request`)."""
        self.scheduler.add_request(Request(
            request.request_id, request.prompt_token_ids, request.sampling_params,
            eos_token_id=request.eos_token_id, arrival_time=request.arrival_time,
            priority=request.priority, cache_salt=request.cache_salt))

    def abort_requests(self, request_ids) -> None:
        """Finish requests decided outside the scheduler (vLLM's `abort_requests`):
        the client's aborts, and the stop strings the front end's detokenizer
        found. Their blocks are free before the next `schedule()`. Stop tokens,
        max_tokens and the length limit never come here: the scheduler decides
        those itself in `update_from_output`. Unknown ids are ignored (the
        request may have finished meanwhile)."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.num_free_blocks

    def num_free_cpu_blocks(self) -> int:
        return self.scheduler.cpu_block_pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the executor's worker processes (none with one rank)."""
        self.executor.shutdown_step_thread()
        self.executor.shutdown()

    def step(self) -> EngineCoreOutputs:
        """One synchronous step: schedule, execute, update; the next step is
        scheduled only once this one's tokens are known."""
        t0 = time.monotonic()
        so, prompt_tokens = self._schedule()
        t1 = time.monotonic()
        mro = self.executor.execute_model(so)
        return self._update(so, mro, prompt_tokens, {"start": t0, "scheduled": t1, "executed": time.monotonic()})

    def step_with_batch_queue(self) -> EngineCoreOutputs | None:
        """One step of asynchronous scheduling (vLLM's `step_with_batch_queue`).

        While the queue has room, schedule the next batch and submit it without
        waiting: its running requests compute the position of the token still in
        flight (a placeholder). When the queue is full (two batches: one runs, the
        next waits behind it), wait for the oldest and update from it. Returns
        None when it only scheduled, so that the busy loop can take the
        messages that arrived before it schedules again."""
        q = self.batch_queue
        if len(q) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            t0 = time.monotonic()
            so, prompt_tokens = self._schedule()
            if so.total_num_scheduled_tokens > 0 or not q:
                q.append((self.executor.execute_model_async(so), so, prompt_tokens, t0, time.monotonic()))
                if len(q) < self.batch_queue_size and so.total_num_scheduled_tokens > 0:
                    return None
        if not q:
            return None
        fut, so, prompt_tokens, t0, t1 = q.popleft()
        mro, t_exec, t2 = fut.result()  # a step that raised raises here: the engine is dead
        out = self._update(so, mro, prompt_tokens,
                           {"start": t0, "scheduled": t1, "execute_start": t_exec, "executed": t2})
        self._check_placeholders()
        return out

    def _check_placeholders(self) -> None:
        """Each placeholder is a token of a batch still in the queue: a request can
        never have more than the queue holds. Fails fast (the engine dies with this
        message) instead of scheduling positions whose tokens will never come."""
        n = len(self.batch_queue)
        for req in self.scheduler.requests.values():  # preempted ones too: they wait for theirs
            if not 0 <= req.num_output_placeholders <= n:
                raise RuntimeError(
                    f"request {req.request_id!r} has {req.num_output_placeholders} output placeholders with "
                    f"{n} step(s) in flight: a token that came back did not replace its placeholder")

    def _schedule(self):
        so = self.scheduler.schedule()
        # Prompt tokens in this step: schedule() already advanced each request by Δ.
        reqs = self.scheduler.requests
        prompt_tokens = sum(
            max(0, min(d, reqs[r].num_prompt_tokens - (reqs[r].num_computed_tokens - d)))
            for r, d in so.num_scheduled_tokens.items())
        return so, prompt_tokens

    def _update(self, so, mro, prompt_tokens: int, stamps: dict[str, float]) -> EngineCoreOutputs:
        outputs = self.scheduler.update_from_output(so, mro)
        if mro.spec_token_ids:  # the proposer's drafts, for the next schedule()
            self.scheduler.update_draft_token_ids(mro.spec_token_ids)
        lps = mro.logprobs or {}
        plps = mro.prompt_logprobs_dict or {}
        for o in outputs:
            if o.request_id in lps:
                o.logprobs = lps[o.request_id][:len(o.new_token_ids)]
            o.prompt_logprobs = plps.get(o.request_id)
        res = EngineCoreOutputs(outputs, self.make_stats(), num_prompt_tokens_computed=prompt_tokens)
        for nr in so.scheduled_new_reqs:
            if nr.req_id not in self._seen:
                self._seen.add(nr.req_id)
                res.first_scheduled.append(nr.req_id)
        self._seen -= so.finished_req_ids
        res.timestamps = {**stamps, "updated": time.monotonic()}
        return res

    def spec_decoding_stats(self) -> dict | None:
        """Acceptance rate and per-position acceptance of verified drafts: the
        fields of `metrics.stats.SpecDecodingStats` as a dict, None without
        speculative decoding. Every rank verifies; rank 0's counts are the ones
        behind the tokens the engine emits."""
        stats = self.executor.collective_rpc("spec_decoding_stats")[0]
        return None if stats is None else dataclasses.asdict(stats)

    def make_stats(self) -> SchedulerStats:
        s = self.scheduler
        pc = s.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(len(s.running), len(s.waiting) + len(s.staging),
                              s.kv_cache_manager.usage, pc.queries, pc.hits, s.num_preemptions)


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
            while True:
                try:
                    kind, payload = self.input_queue.get(block=block)
                except queue.Empty:
                    break
                block = False
                if kind == EngineCoreRequestType.SHUTDOWN:
                    return
                self._handle_client_request(kind, payload)
            if self.scheduler.has_unfinished_requests() or self.batch_queue:
                out = self.step() if self.batch_queue is None else self.step_with_batch_queue()
                if out is not None:
                    self.output_queue.put((EngineCoreOutputType.OUTPUTS, out))

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


def run_engine_core(config, input_address: str, output_address: str, executor_class=None,
                    num_threads: int | None = None, log_level: int = logging.INFO,
                    parent_pid: int | None = None) -> None:
    """The core process's body (vLLM's `EngineCoreProc.run_engine_core`): build the
    core, run the busy loop until SHUTDOWN (or SIGTERM, or the front end's death),
    and exit with 0; on any error tell the front end (DEAD) and exit with 1."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s [core]: %(message)s")

    def _on_term(signum, frame):
        raise SystemExit(0)  # unwinds the loop, so the executor's workers stop too

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C goes to the front end, which shuts us down
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)  # the front end's choice, not torch's default
    ctx = zmq.Context()
    core, status = None, 0
    try:
        core = EngineCoreProc(config, input_address, output_address, ctx, executor_class, parent_pid)
        core.run_busy_loop()
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001 - whatever kills the loop kills the engine
        logger.exception("engine core died: %r", e)
        status = 1
        report_dead(core, ctx, output_address, e)
    finally:
        if core is not None:
            core.close()
        ctx.destroy(linger=0)
    os._exit(status)  # skip torch's interpreter teardown; nothing is left to flush


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
