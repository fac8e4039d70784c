"""Kernel tests run Triton through its interpreter when no CUDA device is visible.

TRITON_INTERPRET is read when a @triton.jit function is defined, so it must be set before any
kernel module is imported; conftest is loaded before the test modules of this folder.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
