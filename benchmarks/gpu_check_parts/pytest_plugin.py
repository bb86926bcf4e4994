"""`pytest -p gpu_check_parts.pytest_plugin`: the test run imports `mini_vllm`
from this checkout, installed or not (see `environment.use_source_tree`), and
writes each failure to the log the moment it happens."""
import sys

from gpu_check_parts.cuda_tests import FAILED_PREFIX
from gpu_check_parts.environment import use_source_tree

use_source_tree()


def pytest_runtest_logreport(report) -> None:
    """A failed test's id and error, in the log at once: a run that the deadline
    interrupts (or kills) may never reach pytest's summary or its JUnit XML."""
    if report.failed:
        print(f"\n{FAILED_PREFIX}{report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n",
              file=sys.stderr, flush=True)
