"""A front end that dies by SIGKILL while its engine core runs in another process.

Run by tests/test_ch5_engine_core_proc.py: builds an engine with the core in
its own process, prints the core's PID (one line), then kills itself with
SIGKILL, which runs no finalizer and no atexit hook. The test then checks that
the core notices and exits instead of living on as an orphan.

No arguments; the test's environment is inherited.
"""
import os
import signal
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent  # engine_utils lives there (also in a mutant's copy)


def main() -> None:
    sys.path.insert(0, str(TESTS))
    from engine_utils import make_llm

    llm = make_llm(block_size=16, multiprocess_mode=True)
    print(llm.llm_engine.engine_core.proc.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":  # the spawned core re-imports this module: it must start nothing
    main()
