"""Overlapped decode: queue the next decode step on the device before reading back this one.

Without it, every decode step ends with the host waiting for the sampled ids and then doing
its own work (finishing requests, sending tokens out, building the next batch) while the GPU
sits idle: at batch 1 on an 8B model that is a sizeable share of the step (measured:
docs/benchmarks.md, Figures behind design choices). With it, step n+1 is launched with step
n's samples as its input ids, still on the device, and the host reads back and processes
step n while the GPU runs n+1.

What that costs and why it stays exact:
- A request step n finishes (a stop token) has already been given step n+1; that row's
  sample is dropped. Its KV for the final token is valid (its input was the real token).
- A request that reaches its length limit at step n is known to before reading step n back,
  so it is left out of step n+1.
- It runs ahead only when the decode is what would run next anyway: no prompt mid-chunk and
  no waiting request a prefill would admit now (a backlog waiting for KV does not stop it).
- Only requests whose sampling reads nothing the host has not yet seen run ahead: no
  penalties (they count output tokens), no unverified jump-forward tokens, and `min_tokens`
  already reached. Any other request in the batch makes the step wait.
- A grammar's mask for step n+1 needs step n's token, so a step with constrained rows is
  queued in two halves: its forward before step n is read back, its sampling after (the host
  advances the grammars with step n's tokens and fills the masks while the forward runs). The
  masks are filled in a thread (`GrammarManager.start_fill`, where the backend fills without
  the GIL) while the scheduler's thread applies step n's tokens, so the two host costs add up
  to the longer of them, not their sum; jump-forward waits for the fill. A
  request that step n finishes, or whose grammar then forces text (jump-forward), has its row
  of step n+1 dropped (`Launched.dropped`); a jumped request also gives back the KV that row
  wrote, so the extend for its forced tokens recomputes it exactly as without overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from braid.runtime.executor.sampler import SampleResult
from braid.runtime.forward_batch import ForwardMode, to_device
from braid.runtime.scheduler.batch import StepPlan
from braid.runtime.scheduler.request import Req, ReqStatus, RequestTable


@dataclass(frozen=True)
class Launched:
    """A decode step queued on the device whose samples the host has not read yet. `result`
    is None while only its forward is queued (`logits`: its output, to be sampled once the
    grammar masks are known). `dropped`: the `id`s of requests whose row's sample is not
    theirs to keep."""

    plan: StepPlan
    result: SampleResult | None
    logits: torch.Tensor | None = None
    dropped: frozenset[int] = frozenset()


def can_run_ahead(req: Req) -> bool:
    """Whether `req` can sample its next token before its current one is read back."""
    p = req.params
    return req.unverified == 0 and not p.reads_output and len(req.output_ids) + 1 >= p.min_tokens


def finishes_by_length(req: Req) -> bool:
    """Whether the token `req` is sampling now (not yet appended) is its last allowed one."""
    return len(req.output_ids) + 1 >= req.max_new_tokens


def next_step(
    launched: Launched,
    reqs: RequestTable,
    admits_now: Callable[[], bool],
    make_room: Callable[[int], bool],
    page_size: int,
) -> tuple[list[Req], torch.Tensor, list[int]] | None:
    """Whether the decode step after `launched` should be queued now, fed by its samples on the
    device: when that step is what would run next anyway (no prompt mid-chunk, no jump-forward
    extend, nothing `admits_now`, every running request in the step and able to sample ahead,
    pages free after `make_room`). Returns its requests, their input ids and the rows of
    `launched`'s samples those are, or None."""
    if launched.plan.batch.mode is not ForwardMode.DECODE:
        return None
    if reqs.count(ReqStatus.PREFILLING, ReqStatus.JUMPED):
        return None
    if admits_now():
        return None  # a prefill comes first
    in_step = launched.plan.reqs
    ids_in_step = {id(r) for r in in_step}
    if any(id(r) not in ids_in_step for r in reqs.view(ReqStatus.RUNNING)):
        return None
    keep = [i for i, r in enumerate(in_step) if not r.finished and not finishes_by_length(r)]
    if not keep or not all(can_run_ahead(in_step[i]) for i in keep):
        return None
    nxt = [in_step[i] for i in keep]
    if not make_room(sum(1 for r in nxt if r.kv_len % page_size == 0)):
        return None
    if launched.dropped:
        return None  # rows without a sample to feed the next step
    ids = launched.result.next_ids
    if len(keep) < len(in_step):
        ids = ids[to_device(keep, ids.device)]
    return nxt, ids, keep
