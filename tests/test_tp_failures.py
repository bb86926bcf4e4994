"""A tensor-parallel worker that dies or raises must make the engine fail fast
with an error naming the rank (no hang), and leave no worker process behind."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from engine_utils import greedy, make_llm, run_greedy
from tp_utils import fail_on_rank, wait_no_tp_children

PROMPTS = [[11, 12, 13, 14, 15] * 4, [200, 300, 400]]


def test_killed_worker_fails_fast_with_a_clear_error():
    """SIGKILL lands while the driver is stepping (likely inside a collective)."""
    llm = make_llm(tensor_parallel_size=2)
    eng = llm.llm_engine
    for i, p in enumerate(PROMPTS * 4):
        eng.add_request(str(i), {"prompt_token_ids": p}, greedy(400))
    eng.step()
    pid = eng.engine_core.executor.procs[0].pid
    killed_at = []

    def kill():
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    killer = threading.Timer(0.5, kill)
    killer.start()
    with pytest.raises(RuntimeError, match=r"rank 1 \(exit code -9\) died"):
        while eng.has_unfinished_requests():
            eng.step()
    killer.join()
    assert killed_at, "the workload finished before the kill: make it longer"
    assert time.monotonic() - killed_at[0] < 20, "the engine took too long to notice a dead worker"
    with pytest.raises(RuntimeError, match="rank 1"):
        eng.step()  # stays failed, answers at once
    assert not wait_no_tp_children()


def test_exception_in_one_worker_fails_fast_instead_of_hanging():
    """Rank 1 raises while rank 0 waits in a collective for its result."""
    llm = make_llm(tensor_parallel_size=2)
    ex = llm.llm_engine.engine_core.executor
    assert ex.collective_rpc(fail_on_rank, 5) == [0, 1]  # no rank 5: nobody fails
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(exit code 1\) died"):
        ex.collective_rpc(fail_on_rank, 1)
    assert time.monotonic() - t0 < 20, "a failing worker must not leave the driver waiting"
    with pytest.raises(RuntimeError, match="rank 1"):
        run_greedy(llm, PROMPTS[:1], 2)
    assert not wait_no_tp_children()
