"""Kernel tests run the Triton kernels on CUDA when it is present, else on CPU through Triton's
interpreter. TRITON_INTERPRET must be set before a kernel module is imported (a `@triton.jit`
function picks interpreted or compiled when it is defined), hence here, at the top; the
runtime's spawned scheduler processes inherit it."""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Float dtypes the CPU interpreter computes correctly (its bfloat16 arithmetic is wrong).
CPU_DTYPES = (torch.float32, torch.float16)


@pytest.fixture(autouse=True)
def _skip_gpu_tests_without_cuda(request):
    if request.node.get_closest_marker("gpu") and not HAS_CUDA:
        pytest.skip("needs a CUDA device")


@pytest.fixture
def device() -> torch.device:
    """Where the small tests run: CUDA (compiled kernels) if present, else CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
