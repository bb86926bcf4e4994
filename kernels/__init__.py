"""Triton kernels of the course (`mini_vllm.kernels`).

Every kernel has a plain-PyTorch reference with the same signature in its
chapter package, and tests compare the two.

Without CUDA, the kernels run in Triton's interpreter on the CPU. The
interpreter is chosen when a kernel is *defined*, so the switch is made here,
before any kernel module is imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
