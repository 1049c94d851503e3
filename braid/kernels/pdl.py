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

`enabled(device, kind)` says whether a launcher should use it: a CUDA device of capability 9.0
or later, not Triton's interpreter (which has no inline PTX), and `kind` among those
`BRAID_PDL` names (by default only fp8's GEMV: on an H200 PDL made fp8's batch-1 decode 4%
faster and bf16's and int4's 3-5% slower; docs/benchmarks.md). Captured into a CUDA graph,
the launches keep their programmatic edges.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# The launchers that use PDL by default, by kind (`enabled`'s `kind`).
KINDS = ("int4", "int8", "fp8", "skinny")
DEFAULT_KINDS = frozenset({"fp8"})


def kinds() -> frozenset[str]:
    """The kinds `BRAID_PDL` names: "0" none, "1" or "all" every kind, else a comma-separated
    list of KINDS; unset, DEFAULT_KINDS."""
    return _parse(os.environ.get("BRAID_PDL"))


@functools.cache
def _parse(value: str | None) -> frozenset[str]:
    """`kinds` of one setting, parsed once (the launchers ask at every launch)."""
    if value is None:
        return DEFAULT_KINDS
    if value in ("1", "all"):
        return frozenset(KINDS)
    named = frozenset(v.strip() for v in value.split(",")) - {"0", ""}
    unknown = named - set(KINDS)
    if unknown:
        raise ValueError(
            f"BRAID_PDL names unknown kernels {sorted(unknown)}: use 0, all or some of {KINDS}"
        )
    return named


def enabled(device: torch.device, kind: str | None = None) -> bool:
    """Whether a launcher of `kind` on `device` launches with PDL (read at each launch, so a
    benchmark compares settings in one process); with no kind, whether any kind does (the
    kernels that trigger). Never on a CPU, under Triton's interpreter or below sm_90."""
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    on = kinds()
    if not (kind in on if kind is not None else on):
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
