"""The core client against a dying core and an unfriendly start-up (vLLM's
`MPClient` in `vllm/v1/engine/core_client.py`, `get_mp_context` in
`vllm/utils/system_utils.py`):

- no send waits for ever: a send to a core that was SIGKILLed raises
  `EngineDeadError`, noticed from the process sentinel (not after a timeout);
- the death is reported to everything waiting at once, not after joins;
- aborts sent to a dead core are dropped, not raised;
- no socket file outlives the client (clean shutdown, or the front end killed);
- the core is forked (it runs in a fresh thread, which OpenMP's pool left behind
  by fork cannot hang), and a main module that spawn cannot import is refused
  with the fix in the message.

Every wait is bounded by a hang guard far above what the engine needs."""
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from engine_utils import SMALL_KV, make_llm, target_path
from mini_vllm import SamplingParams
from mini_vllm.engine import core_client
from mini_vllm.engine.exceptions import EngineDeadError
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.engine.utils import MP_METHOD_ENV, get_mp_context
from server_utils import pid_alive

HANG_GUARD_S = 60
TESTS = Path(__file__).resolve().parent
PROGRAMS = TESTS / "programs"


def _engine() -> LLMEngine:
    return LLMEngine.from_engine_args(target_path(), dtype="float32", device="cpu", kv_cache_memory_bytes=SMALL_KV,
                                      block_size=16, multiprocess_mode=True)


def _kill_and_wait(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    for _ in range(HANG_GUARD_S * 100):
        if not pid_alive(pid):
            return
        time.sleep(0.01)
    raise AssertionError(f"setup: the core (pid {pid}) did not die of SIGKILL")


def _in_thread(fn):
    """fn() in a daemon thread; (result or exception, seconds), or None if it hung."""
    box = []

    def run():
        t0 = time.monotonic()
        try:
            box.append((fn(), time.monotonic() - t0))
        except BaseException as e:  # noqa: BLE001
            box.append((e, time.monotonic() - t0))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    return box[0] if box else None


def test_send_to_a_killed_core_raises_from_the_sentinel_without_the_monitor(monkeypatch):
    """The monitor thread is switched off, so the send alone must see the death: it
    finds no core connected and must neither block (the bug: a blocking send on a
    socket whose peer is gone waits for ever) nor wait out SEND_TIMEOUT_S (the
    sentinel says the process has exited)."""
    monkeypatch.setattr(core_client, "monitor_core_process", lambda *a: None)
    eng = _engine()
    try:
        _kill_and_wait(eng.engine_core.proc.pid)

        def send_until_refused():
            for i in range(10_000):  # the first sends may still go out before ZeroMQ sees the pipe close
                eng.engine_core.add_request(eng.processor.process_inputs(f"r{i}", "def f():",
                                                                         SamplingParams(max_tokens=2), None, 0))
                time.sleep(0.001)
            return "never refused"

        got = _in_thread(send_until_refused)
        assert got is not None, "a send to a killed core blocked for ever (blocking send on a peerless socket)"
        err, took = got
        assert isinstance(err, EngineDeadError), f"a send to a killed core must raise EngineDeadError, got {err!r}"
        assert took < core_client.SEND_TIMEOUT_S, (
            f"the send gave up after {took:.1f} s, by its timeout, instead of seeing the process sentinel")
    finally:
        eng.shutdown()


def test_a_killed_core_fails_the_waiting_caller_at_once_and_aborts_are_dropped():
    eng = _engine()
    try:
        eng.add_request("long", "def main():", SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        eng.step()
        os.kill(eng.engine_core.proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()

        def drain():
            for _ in range(10_000):  # outputs already sent come first, then the error
                eng.step()

        got = _in_thread(drain)
        assert got is not None, "step() hung after the core process was killed"
        err, _ = got
        took = time.monotonic() - t_kill
        assert isinstance(err, EngineDeadError) and "status -9" in str(err), f"expected the kill named: {err!r}"
        # The sentinel fires at the exit; the report waits DEAD_GRACE_S (0.25 s) for a DEAD
        # message at most. Waiting on joins instead (the process, then 2 s for the receiver)
        # takes 2 s or more by construction.
        assert took < 1.5, f"the death of the core reached step() after {took:.2f} s: noticed after joins, not at once"
        eng.abort_request(["long"])  # must not raise: nothing is left to free in a dead core
        eng.engine_core.abort_requests(["long", "other"])
        with pytest.raises(EngineDeadError):
            eng.add_request("later", "x", SamplingParams(max_tokens=2))
    finally:
        eng.shutdown()


def test_no_socket_file_outlives_shutdown(monkeypatch, socket_dir):
    tmp_path = socket_dir
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    llm = make_llm(block_size=16, multiprocess_mode=True)
    try:
        during = sorted(p.name for p in tmp_path.iterdir())
    finally:
        llm.shutdown()
    assert len(during) == 2 and all(n.startswith(f"mini-vllm-{os.getpid()}-") for n in during), (
        f"setup: the client's two ipc socket files must exist while it runs: {during}")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not left, f"socket files left after shutdown (ZeroMQ does not remove an ipc file): {left}"


def test_the_core_removes_the_socket_files_when_its_front_end_is_killed(socket_dir):
    tmp_path = socket_dir
    r = subprocess.run([sys.executable, str(PROGRAMS / "front_end_killed.py")], capture_output=True, text=True,
                       timeout=HANG_GUARD_S, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    core = int(r.stdout.split()[0])
    for _ in range(HANG_GUARD_S * 10):  # the core looks for its parent once a second
        if not pid_alive(core):
            break
        time.sleep(0.1)
    assert not pid_alive(core), "the core kept running after its front end was killed"
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not left, f"socket files left after the front end was killed (the core must remove them): {left}"


def test_socket_paths_fit_a_unix_socket(monkeypatch, socket_dir, caplog):
    """ZeroMQ refuses an ipc:// path past 107 bytes ("File name too long", from the core's
    thread, after the server had started): a deep TMPDIR must not break the engine."""
    from mini_vllm.engine.utils import SUN_PATH_MAX, ipc_socket_base
    name = f"mini-vllm-{os.getpid()}-0123abcd"
    monkeypatch.setattr(tempfile, "tempdir", str(socket_dir))
    assert ipc_socket_base(name) == str(socket_dir / name), "a short TMPDIR must hold the sockets"
    deep = socket_dir / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with caplog.at_level("WARNING", logger="mini_vllm"):
        base = ipc_socket_base(name)
    assert len(f"{base}-out".encode()) <= SUN_PATH_MAX and base == f"/tmp/{name}", (
        f"a TMPDIR too deep for a Unix socket gave {base!r}: the core would fail to bind")
    assert "too deep for a Unix socket" in caplog.text, "the move to /tmp must be logged"


def test_start_method_variable_is_checked(monkeypatch):
    monkeypatch.setenv(MP_METHOD_ENV, "threads")
    with pytest.raises(ValueError, match=f"{MP_METHOD_ENV} must be one of \\['fork', 'spawn', 'forkserver'\\]"):
        get_mp_context()
    monkeypatch.setenv(MP_METHOD_ENV, "spawn")
    assert get_mp_context().get_start_method() == "spawn", f"{MP_METHOD_ENV}=spawn was not honoured"


NUMBA_POOL_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numba import njit, prange
    from mini_vllm.engine.utils import get_mp_context
    before = get_mp_context().get_start_method()

    @njit(parallel=True)
    def total(a):
        s = 0.0
        for i in prange(a.shape[0]):
            s += a[i]
        return s

    total(np.ones(64))  # starts numba's thread pool, as the CPU kernels do on 2+ threads
    print(before, get_mp_context().get_start_method())
""")


@pytest.mark.skipif(sys.platform != "linux", reason="fork is the default start method on Linux only")
def test_a_running_numba_openmp_pool_makes_the_core_spawn():
    """numba's OpenMP pool terminates a child forked after it started, at the child's first
    parallel loop (the engine benchmark's 2-thread engine core died that way, after an
    in-process run): the core must then start with spawn."""
    env = {k: v for k, v in os.environ.items() if k != MP_METHOD_ENV}
    env.update(NUMBA_THREADING_LAYER="omp", NUMBA_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", NUMBA_POOL_SCRIPT], capture_output=True, text=True, env=env,
                       timeout=300)
    if r.returncode != 0 and "threading layer" in r.stderr:
        pytest.skip(f"numba's OpenMP threading layer is unavailable here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["fork", "spawn"], (
        f"expected fork before numba's OpenMP pool started and spawn after it, got {r.stdout!r}: a core forked "
        "after the pool started is terminated at its first parallel loop")


STDIN_SCRIPT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(TESTS)!r})
    from engine_utils import make_llm
    from mini_vllm import SamplingParams
    llm = make_llm(block_size=16, multiprocess_mode=True)
    out = llm.generate(["def f():"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    print(llm.llm_engine.engine_core.start_method, len(out[0].outputs[0].token_ids))
""")


def _run(cmd: list[str], script: str | None = None, method: str | None = None) -> subprocess.CompletedProcess:
    """Run a Python program in a session of its own; if it hangs, kill the whole session
    (its engine core too) and raise subprocess.TimeoutExpired."""
    env = {k: v for k, v in os.environ.items() if k not in (MP_METHOD_ENV, "OMP_NUM_THREADS")}
    if method is not None:
        env[MP_METHOD_ENV] = method
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)
    try:
        out, err = p.communicate(script, timeout=HANG_GUARD_S * 2)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the program's own session: its core is in it
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _run_stdin(script: str, method: str | None = None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-"], script, method)


def test_a_script_read_from_stdin_runs_its_core_forked():
    """`python - <<EOF` builds an LLM: spawn would re-run `<stdin>` in the core and die.
    No OMP_NUM_THREADS: numpy's OpenBLAS pool runs as on any machine."""
    r = _run_stdin(STDIN_SCRIPT)
    assert r.returncode == 0, f"a script read from stdin could not start its engine core: {r.stderr[-1500:]}"
    assert r.stdout.split() == ["fork", "3"], f"expected a forked core and 3 tokens, got {r.stdout!r}"


def test_spawn_refuses_a_main_module_it_cannot_import_and_says_how_to_fix_it():
    t0 = time.monotonic()
    r = _run_stdin(STDIN_SCRIPT, "spawn")
    assert r.returncode != 0, f"spawn cannot re-import <stdin>, yet the script went on: {r.stdout!r}"
    err = r.stderr
    assert "RuntimeError" in err and "'<stdin>'" in err and 'if __name__ == "__main__":' in err \
        and f"{MP_METHOD_ENV}=fork" in err, f"the error must name the main module and both fixes: {err[-1500:]}"
    assert "before it was ready" not in err, f"refused only after starting a doomed core: {err[-1500:]}"
    assert time.monotonic() - t0 < HANG_GUARD_S


def test_a_core_forked_after_openmp_ran_here_does_not_hang(tmp_path):
    """fork copies one thread: once PyTorch has run a parallel op here, OpenMP's pool
    threads are gone in a forked child, and a parallel op on the child's main thread
    then waits for them for ever; the core runs in a thread of its own instead."""
    script = tmp_path / "omp_then_llm.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import torch
        if __name__ == "__main__":
            torch.set_num_threads(2)
            a = torch.randn(512, 512)
            (a @ a).sum()  # starts OpenMP's thread pool in this process
            from engine_utils import make_llm
            from mini_vllm import SamplingParams
            llm = make_llm(block_size=16, multiprocess_mode=True)
            out = llm.generate(["def f():"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
            print(llm.llm_engine.engine_core.start_method, len(out[0].outputs[0].token_ids))
    """))
    try:
        r = _run([sys.executable, str(script)])
    except subprocess.TimeoutExpired:
        pytest.fail("the engine hung: its core was forked from a process with OpenMP's pool running "
                    "and ran a parallel op on the main thread it inherited")
    assert r.returncode == 0, r.stderr[-1500:]
    assert r.stdout.split() == ["fork", "3"], f"expected a forked core and 3 tokens, got {r.stdout!r}"
