"""Triton kernels of the course (`mini_vllm.kernels`), and the CPU kernels beside them.

Every kernel has a plain-PyTorch reference with the same signature in its
chapter package, and tests compare the two.

Without CUDA, the Triton kernels run in Triton's interpreter on the CPU, which
has to be selected before `triton` is first imported: `prepare_triton()` does it
(`triton_setup.py` says why it is a call and not a side effect of this import).
"""
from .triton_setup import interpreting, prepare_triton  # noqa: F401
