"""Programmatic dependent launch (PDL, sm_90 and later) for the one-row decode kernels.

A batch-1 decode step runs a chain of short kernels; each waits for the one before it to end
before its programs are even placed on the SMs, and a GEMV then waits one memory latency more
for its first weights. With PDL a kernel launched with `launch_pdl=True` may start while the
kernel before it in the stream still runs, once every program of that kernel has called
`trigger` (or ended):

- the kernel before (`trigger` at its start: a norm, the activation, attention's reduction)
  lets the next one start at once;
- the dependent kernel prefetches into L2 what does not depend on the kernel before (a GEMV's
  weights: `prefetch_l2`), then `wait`s; `griddepcontrol.wait` returns when the kernel before
  has ended and its writes are visible. Only then does it read that kernel's output.

The rule that keeps it correct: every program of a kernel launched with PDL passes `wait`
before it reads anything an earlier kernel wrote, and before it ends (so a kernel after it
that waits for it waits, through it, for the ones before). Triggering early is always safe:
it lets the dependent start, never read.

`enabled(device)` says whether a launcher should use it: a CUDA device of capability 9.0 or
later, not Triton's interpreter (which has no inline PTX), and `BRAID_PDL` not "0" (the
benchmarks compare both in one run). Captured into a CUDA graph, the launches keep their
programmatic edges.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (read at each launch: `BRAID_PDL=0`
    turns it off for a comparison in the same process)."""
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    if os.environ.get("BRAID_PDL", "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def trigger(ON: tl.constexpr):
    """Lets the kernel after this one (if launched with PDL) start now."""
    if ON:
        gdc_launch_dependents()


@triton.jit
def wait(ON: tl.constexpr):
    """Returns when the kernel before this one has ended and its writes are visible."""
    if ON:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Asks L2 for the 128-byte line at each of `ptrs` (`prefetch.global.L2`, one per
    element, per thread: nothing returned, nothing waited for)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0",
        "=r,l",
        [ptrs.to(tl.int64, bitcast=True)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
