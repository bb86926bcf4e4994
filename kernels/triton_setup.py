"""Where the course's Triton kernels run: compiled on CUDA, in Triton's interpreter on a CPU.

vLLM counterpart: none. vLLM's Triton kernels (`vllm/attention/ops/`,
`vllm/model_executor/layers/fused_moe/fused_moe.py`) run on GPUs only; the
course also runs them on a CPU, so that a learner without a GPU can step through
them and the tests check them everywhere.

Triton picks the interpreter from the environment variable TRITON_INTERPRET, and
reads it at two moments: when `triton` is first imported (its own library
functions, `tl.sum`, `tl.max`, `tl.cdiv`, are `@triton.jit` functions defined
then) and when a kernel is defined or launched. So the switch must come before
`triton` is imported at all, and it is a change to the process environment.

Invariants:
* importing a module of `mini_vllm` never changes the process environment; the
  switch happens only in `prepare_triton()`, which the code that chose a Triton
  kernel calls (the Triton attention backend, the Triton MoE path, Chapter 4's
  Triton rejection sampler, a notebook or a benchmark), and it logs that it did;
* a Triton kernel module imported on a machine without CUDA, with
  TRITON_INTERPRET unset, raises an ImportError saying what to call, instead of
  defining kernels that fail at their first launch with Triton's "0 active
  drivers"; TRITON_INTERPRET=0 set on purpose is obeyed (compiling the kernels
  for a GPU on a machine without one, as tests/programs/compile_kernels.py does);
* `triton` already imported without the interpreter on a machine without CUDA
  is an error naming the cause: setting the variable then would leave
  `tl.sum` and the others compiled-only, and the kernels would fail inside.
"""
from __future__ import annotations

import logging
import os
import sys

import torch

logger = logging.getLogger("mini_vllm")

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    """Whether Triton kernels defined now run in the interpreter."""
    return os.environ.get(INTERPRET_ENV, "0") == "1"


def prepare_triton() -> None:
    """Before the first import of a Triton kernel module: on a machine without CUDA,
    select Triton's interpreter (TRITON_INTERPRET=1 in this process's environment,
    inherited by the processes it starts). Nothing to do on CUDA or when already set."""
    if torch.cuda.is_available() or interpreting():
        return
    if "triton" in sys.modules:
        raise RuntimeError(
            f"Triton kernels on a CPU run in Triton's interpreter, which must be selected before `triton` "
            f"is imported, and `triton` is already imported without it: set {INTERPRET_ENV}=1 in the "
            "environment before starting Python (or call mini_vllm.kernels.prepare_triton() before "
            "anything imports triton)")
    os.environ[INTERPRET_ENV] = "1"
    logger.info("no CUDA device: Triton kernels run in Triton's interpreter (%s=1 set for this process)",
                INTERPRET_ENV)


def require_triton_mode(module: str) -> None:
    """At the top of a Triton kernel module, before it imports triton."""
    if not torch.cuda.is_available() and INTERPRET_ENV not in os.environ:
        raise ImportError(
            f"{module}: there is no CUDA device, so its Triton kernels can only run in Triton's "
            f"interpreter, which is not selected ({INTERPRET_ENV} is unset): call mini_vllm.kernels.prepare_triton() before importing "
            f"it (or set {INTERPRET_ENV}=1 before starting Python)")
