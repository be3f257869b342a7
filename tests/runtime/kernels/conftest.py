"""Kernel tests run on the Triton interpreter when no CUDA GPU is present.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when runtime.kernels.flash_attention is
imported, so it is set here, before any test module of this directory imports the kernels.
`test_flash_kernels_are_interpreted_without_cuda` checks that it took effect.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
