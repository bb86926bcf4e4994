"""A tensor-parallel worker that dies or raises must make the engine fail fast
with an error naming the rank (no hang), and leave no worker process behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_utils import greedy, make_llm, run_greedy
from tp_utils import fail_on_rank, wait_no_tp_children

PROMPTS = [[11, 12, 13, 14, 15] * 4, [200, 300, 400]]
PROGRAMS = Path(__file__).resolve().parent / "programs"


def test_killed_worker_fails_fast_with_a_clear_error():
    """SIGKILL lands inside a step, after rank 1 was sent the step and before rank
    0's forward, whose collectives then meet a dead peer. The kill comes from the
    step itself, not from a timer, so no engine is fast enough to finish first."""
    llm = make_llm(tensor_parallel_size=2)
    eng = llm.llm_engine
    for i, p in enumerate(PROMPTS * 4):
        eng.add_request(str(i), {"prompt_token_ids": p}, greedy(400))
    eng.step()
    ex = eng.engine_core.engine_core.executor
    pid, driver = ex.procs[0].pid, ex.driver_worker
    real_execute = driver.execute_model
    killed_at = []

    def execute_model(*args):
        if not killed_at:
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)
        return real_execute(*args)

    driver.execute_model = execute_model
    with pytest.raises(RuntimeError, match=r"rank 1 \(exit code -9\) died"):
        while eng.has_unfinished_requests():
            eng.step()
    assert killed_at, "the driver's step never ran rank 0's execute_model: the kill did not happen"
    # A hang guard: a closed socket is noticed at once; only a wait for the 60 s
    # group timeout (or a hang) gets near this bound.
    assert time.monotonic() - killed_at[0] < 20, "the engine took too long to notice a dead worker"
    with pytest.raises(RuntimeError, match="rank 1"):
        eng.step()  # stays failed, answers at once
    assert not wait_no_tp_children()


def test_exception_in_one_worker_fails_fast_instead_of_hanging():
    """Rank 1 raises while rank 0 waits in a collective for its result."""
    llm = make_llm(tensor_parallel_size=2)
    ex = llm.llm_engine.engine_core.engine_core.executor
    assert ex.collective_rpc(fail_on_rank, 5) == [0, 1]  # no rank 5: nobody fails
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(exit code 1\) died"):
        ex.collective_rpc(fail_on_rank, 1)
    assert time.monotonic() - t0 < 20, "a failing worker must not leave the driver waiting"
    with pytest.raises(RuntimeError, match="rank 1"):
        run_greedy(llm, PROMPTS[:1], 2)
    assert not wait_no_tp_children()


def test_bad_engine_argument_found_by_every_rank_stays_a_value_error():
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(tensor_parallel_size=2, max_model_len=100_000)
    assert not wait_no_tp_children(), "a rejected engine must not leave its workers behind"


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to see the orphan")
def test_workers_exit_when_the_driver_is_killed():
    """SIGKILL runs no finalizer: the worker must notice its peer's closed sockets and exit."""
    out = subprocess.run([sys.executable, str(PROGRAMS / "tp_driver_killed.py")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)  # do not leave it behind even when the test fails
        pytest.fail("the worker outlived its killed driver by 20 s (orphaned process)")

