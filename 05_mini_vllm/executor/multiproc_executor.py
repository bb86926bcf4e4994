"""The tensor-parallel executor: one worker per rank, the scheduler once, in the driver.

vLLM counterpart: `vllm/v1/executor/multiproc_executor.py` (`MultiprocExecutor`,
`WorkerProc.worker_busy_loop`, `collective_rpc`). vLLM v1 puts every rank in
a worker process and ships each SchedulerOutput through a shared-memory
`MessageQueue`; here rank 0 lives in the driver (as in vLLM v0) and the
driver broadcasts each call over the gloo group. The engine core sees only
the `Executor` interface (`abstract.py`), exactly as with `UniProcExecutor`.

Protocol (every rank runs the same calls in the same order):
* the driver broadcasts `(method, args)`, then runs `worker.method(*args)`
  itself; ranks 1..N-1 receive it in `worker_busy_loop` and run it too. The
  collectives inside the model (two all-reduces per layer, the logits
  all-gather) pair up because every rank runs the same forward;
* only rank 0's ModelRunnerOutput is used: the others sample too (they hold
  the same gathered logits) but drop the result; their runners learn the
  sampled tokens from the next SchedulerOutput, like rank 0's;
* `collective_rpc` also gathers every rank's result to the driver (tests
  read each rank's KV cache and shard shapes this way);
* `None` is the shutdown message: workers leave the group and exit with
  status 0; a worker whose call raises prints the traceback and exits with 1.

Failure and cleanup:
* a dead worker closes its sockets, so the driver's next collective raises;
  `execute_model` turns that into a RuntimeError naming the rank and its exit
  code, and the executor refuses further work. A peer that hangs instead is
  cut by the group timeout (`DIST_TIMEOUT_S`);
* workers are daemons started with `torch.multiprocessing` (spawn); they stop
  on `shutdown()`, when the executor is garbage-collected, or at interpreter
  exit (a `weakref.finalize`), and a worker whose parent died exits when its
  next collective fails.

Across machines: with torchrun-style MASTER_ADDR, MASTER_PORT, RANK=0 and
WORLD_SIZE set in the driver's environment, the executor spawns nothing and
waits for ranks 1..N-1 started elsewhere as `python -m mini_vllm.executor.multiproc_executor`
with the same variables (their RANK); they receive the engine config from rank 0.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import time
import traceback
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mini_vllm.distributed import (broadcast_object, destroy_distributed_environment,
                                   gather_object, init_distributed_environment)
from mini_vllm.distributed.parallel_state import (TORCHRUN_ENV_KEYS, torchrun_env,
                                                  verify_tensor_parallel_size)
from mini_vllm.executor.abstract import Executor
from mini_vllm.models.config import ModelConfig
from mini_vllm.worker.worker import Worker

logger = logging.getLogger("mini_vllm")

DIST_TIMEOUT_S = float(os.environ.get("MINI_VLLM_DIST_TIMEOUT_S", "60"))
def _bind(worker, method):
    """A Worker method name, or a picklable function called as fn(worker, *args)."""
    return getattr(worker, method) if isinstance(method, str) else functools.partial(method, worker)


def worker_busy_loop(rank: int, world_size: int, rendezvous, device: str | None = None) -> None:
    """Body of ranks 1..N-1: join the group, build the Worker, run broadcast calls until None.

    `rendezvous` is the driver's store (host, port), or a "tcp://" init method."""
    if device is None:  # a remote rank: its own accelerator if it has one
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda":
        local = rank % torch.cuda.device_count()
        torch.cuda.set_device(local)  # NCCL needs one device per rank
        device = f"cuda:{local}"
    else:
        # the ranks share the host's cores; oversubscribing them is 10-100x slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if isinstance(rendezvous, tuple):
        store = dist.TCPStore(rendezvous[0], rendezvous[1], world_size, is_master=False,
                              timeout=timedelta(seconds=DIST_TIMEOUT_S))
        store.set(f"mini_vllm/ready/{rank}", "1")  # the driver waits for these, watching us
        group = init_distributed_environment(world_size, rank, device=device,
                                             timeout_s=DIST_TIMEOUT_S, store=store)
    else:
        group = init_distributed_environment(world_size, rank, rendezvous, device, DIST_TIMEOUT_S)
    try:
        config = broadcast_object(None, group)  # rank 0 sends the engine config first
        config.device = device
        worker = Worker(config, group)
        while True:
            msg = broadcast_object(None, group)
            if msg is None:
                break
            method, args, collect = msg
            result = _bind(worker, method)(*args)
            if collect:
                gather_object(result, group)
        destroy_distributed_environment()
        code = 0
    except BaseException:  # the driver sees the closed sockets and names this rank
        traceback.print_exc()
        code = 1
    # os._exit: skip interpreter teardown, where a collective library's background
    # threads can abort the process (SIGABRT) and hide the real exit status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _shutdown(procs: list, state: dict) -> None:
    """Stop the workers; safe to call twice, after a failure, or at exit."""
    group = state.pop("group", None)
    state.pop("store", None)  # the rendezvous port closes with the last reference
    if group is not None:
        if all(p.is_alive() for p in procs):
            try:
                broadcast_object(None, group)  # the polite way: workers leave their loop
            except Exception:  # a peer already gone; the kill below handles it
                pass
        for p in procs:
            p.join(timeout=10)
        try:
            destroy_distributed_environment()
        except Exception:
            pass
        # Every layer shares this coordinator: dropping its groups releases the
        # store they reference, so the rendezvous port closes now, not at GC.
        group.device_group = group.cpu_group = None
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


class MultiprocExecutor(Executor):
    def __init__(self, config, kv_connector=None) -> None:
        tp = config.tensor_parallel_size
        if kv_connector is not None:  # EngineConfig refuses kv_transfer_config with tp > 1
            raise ValueError("kv_connector must be None for the tensor-parallel executor")
        verify_tensor_parallel_size(ModelConfig.from_json(Path(config.model) / "config.json"), tp,
                                    config.enable_expert_parallel)
        self.world_size = tp
        self.procs: list = []
        self._state: dict = {}  # group and store, owned by the finalizer
        self._failed: str | None = None
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self._state)
        env = torchrun_env()
        if env is not None:
            if int(env["WORLD_SIZE"]) != tp or int(env["RANK"]) != 0:
                raise ValueError(f"tensor_parallel_size ({tp}) must equal WORLD_SIZE "
                                 f"({env['WORLD_SIZE']}) and the driver must be RANK 0, "
                                 f"got RANK {env['RANK']}")
            group = init_distributed_environment(
                tp, 0, f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}", config.device,
                DIST_TIMEOUT_S)
        else:
            # Port 0: the OS picks a free port, so concurrent engines never collide.
            store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=DIST_TIMEOUT_S))
            self._state["store"] = store
            self.port = store.port
            ctx = mp.get_context("spawn")  # fork would copy this process's threads and locks
            for rank in range(1, tp):
                p = ctx.Process(target=worker_busy_loop, args=(rank, tp, ("127.0.0.1", store.port),
                                                               config.device),
                                name=f"mini_vllm-tp{rank}", daemon=True)
                p.start()
                self.procs.append(p)
            self._wait_for_workers(store)
            group = init_distributed_environment(tp, 0, device=config.device,
                                                 timeout_s=DIST_TIMEOUT_S, store=store)
        self._state["group"] = group
        self.tp_group = group
        self._call(lambda: None, config)  # ranks > 0 receive the config (remote ones need it)
        self.driver_worker = self._call(lambda: Worker(config, group), None, skip_broadcast=True)
        self.model_config = self.driver_worker.model_config
        self.max_model_len = self.driver_worker.max_model_len
        self.bytes_per_block = self.driver_worker.bytes_per_block  # of this rank's KV heads

    def _wait_for_workers(self, store) -> None:
        """Until every rank checked in; a rank that dies first fails at once, not at the timeout."""
        keys = [f"mini_vllm/ready/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + DIST_TIMEOUT_S
        while not store.check(keys):
            dead = self._dead_workers()
            if dead or time.monotonic() > deadline:
                self.shutdown()
                why = f"worker {', '.join(dead)} died" if dead else "timed out"
                raise RuntimeError(f"tensor-parallel workers failed to start: {why} (a script "
                                   "that starts an engine needs an `if __name__ == '__main__':` "
                                   "guard, since spawned workers re-import it)")
            time.sleep(0.05)

    def _dead_workers(self) -> list[str]:
        return [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.procs)
                if not p.is_alive()]

    def _call(self, local, msg, skip_broadcast: bool = False):
        """Broadcast `msg` to ranks > 0, run `local()` here; any failure is fatal."""
        if self._failed:
            raise RuntimeError(f"the tensor-parallel executor cannot run: {self._failed}")
        dead = self._dead_workers()
        try:
            if dead:
                raise RuntimeError("worker process gone")
            if not skip_broadcast:
                broadcast_object(msg, self.tp_group)
            return local()
        except Exception as e:
            # A peer's closed socket can reach us before its process has exited:
            # give a dying worker a few seconds to show its exit code.
            deadline = time.monotonic() + (0 if isinstance(e, ValueError) else 5)
            while not self._dead_workers() and time.monotonic() < deadline:
                time.sleep(0.05)
            dead = self._dead_workers()
            self._failed = (f"tensor-parallel worker {', '.join(dead)} died" if dead
                            else f"{type(e).__name__}: {e}")
            self.shutdown()  # the ranks are out of step now; nothing can resume
            if isinstance(e, ValueError):
                raise  # bad input (e.g. max_model_len), found by every rank: stays a ValueError
            raise RuntimeError(f"the tensor-parallel executor has failed: {self._failed}") from e

    def rpc(self, method: str, *args):
        """Run `Worker.method(*args)` on every rank; rank 0's result."""
        return self._call(lambda: getattr(self.driver_worker, method)(*args), (method, args, False))

    def collective_rpc(self, method, *args) -> list:
        """Run `method` (a Worker method name, or a module-level function called as
        fn(worker, *args)) on every rank; the results of all ranks, in rank order."""
        def local():
            return gather_object(_bind(self.driver_worker, method)(*args), self.tp_group)
        return self._call(local, (method, args, True))

    def determine_num_blocks(self, max_num_batched_tokens: int) -> tuple[int, int]:
        return self.rpc("determine_num_blocks", max_num_batched_tokens)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, max_num_seqs: int) -> None:
        self.rpc("initialize_cache", num_gpu_blocks, num_cpu_blocks, max_num_seqs)

    def execute_model(self, scheduler_output):
        return self.rpc("execute_model", scheduler_output)

    def check_health(self) -> None:
        if self._failed or self._dead_workers():
            raise RuntimeError(f"the tensor-parallel executor has failed: "
                               f"{self._failed or self._dead_workers()}")

    def shutdown(self) -> None:
        """Stop the workers and leave the group; idempotent. The executor is unusable after."""
        self._failed = self._failed or "it was shut down"
        self._finalizer()


def main() -> None:
    """A remote rank: `RANK=k WORLD_SIZE=N MASTER_ADDR=.. MASTER_PORT=.. python -m mini_vllm.executor.multiproc_executor`."""
    env = torchrun_env()
    if env is None:
        raise SystemExit(f"set {', '.join(TORCHRUN_ENV_KEYS)} (torchrun style) to run a remote rank")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if rank == 0:
        raise SystemExit("rank 0 is the driver: run LLM(..., tensor_parallel_size=WORLD_SIZE) there")
    worker_busy_loop(rank, world, f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}")


if __name__ == "__main__":
    main()
