"""`python tests/fault_server.py serve MODEL [flags]`: the course's server with a fault
planted in its engine, for the tests that need an engine that dies, or steps that
cannot be fast. `server_utils.Server(fault=...)` starts it; the environment
variable MINI_VLLM_TEST_FAULT says which faults (comma-separated):

- "raise-on-marker": a step whose batch brings in a request whose prompt is
  FAULT_MARKER raises inside the executor, in the middle of the step, with
  every other request still in flight. The test decides when the engine dies
  (by sending the marker), so nothing depends on how fast it runs.
- "step-floor:S": every step lasts at least S seconds (it sleeps after the
  forward pass). A request of N output tokens then cannot finish in less than
  N * S seconds, whatever the machine: "still running after X seconds" becomes
  true by construction (N * S well above X) instead of by the engine being slow.

The patches wrap `UniProcExecutor.execute_model` (the server's executor at one
rank) when this file is imported; nothing in `mini_vllm` knows of them. They
are applied at the top level, not under `__main__`, because the engine core
runs in a spawned process, which imports this script again (as
`__mp_main__`) before it builds its executor: the core gets the same faults.
"""
from __future__ import annotations

import os
import sys
import time

from mini_vllm.executor.uniproc_executor import UniProcExecutor

# Token ids no test prompt produces by chance: a prompt of exactly these ids.
FAULT_MARKER = [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 13]


class PlantedFault(RuntimeError):
    """The exception the "raise-on-marker" fault raises inside a step."""


def with_fault(fault: str, execute):
    """`execute` (an executor's execute_model) with one fault planted."""
    if fault == "raise-on-marker":
        def execute_model(self, scheduler_output):
            for nr in scheduler_output.scheduled_new_reqs:
                if list(nr.prompt_token_ids) == FAULT_MARKER:
                    raise PlantedFault(f"planted fault in the step that schedules request {nr.req_id}")
            return execute(self, scheduler_output)
    elif fault.startswith("step-floor:"):
        floor = float(fault.split(":", 1)[1])

        def execute_model(self, scheduler_output):
            t0 = time.monotonic()
            out = execute(self, scheduler_output)
            time.sleep(max(0.0, floor - (time.monotonic() - t0)))
            return out
    else:
        raise SystemExit(f"MINI_VLLM_TEST_FAULT={fault!r}: expected 'raise-on-marker' or 'step-floor:SECONDS'")
    return execute_model


class MarkerFaultExecutor(UniProcExecutor):
    """The "raise-on-marker" fault as an executor class of its own, for offline
    engines (`LLM(..., executor_class=MarkerFaultExecutor)`): a spawned core
    process imports it from this module by name."""

    execute_model = with_fault("raise-on-marker", UniProcExecutor.execute_model)


if __name__ in ("__main__", "__mp_main__"):  # the server, and its spawned engine core
    for f in os.environ["MINI_VLLM_TEST_FAULT"].split(","):
        UniProcExecutor.execute_model = with_fault(f.strip(), UniProcExecutor.execute_model)

if __name__ == "__main__":
    from mini_vllm.entrypoints.cli import main

    sys.exit(main(sys.argv[1:]))
