"""The tensor-parallel group: one process per rank, a torch.distributed group for the
model's collectives (NCCL on CUDA, gloo on CPU) and a gloo group on the host for the plans
rank 0 sends (`plan.py`) and the few values the ranks agree on at start-up.

A model is built for a group inside `sharding(group)`: the parallel layers
(`braid.runtime.layers.parallel`) read it at construction and keep it, as the quantized
layers read `quantization.base.building`. Outside it they hold the whole weight.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer. A dead peer is noticed at once (its sockets
# close); this bounds a live one that stops answering. Rank 0 sends a plan at least every
# `plan.IDLE_TICK_S` while idle, so a follower never waits this long for one.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
# The largest all-reduce the one-shot path takes (`TPGroup.enable_one_shot`): a decode step's
# hidden states up to 128 rows at 4096 in bf16 (64 at 8192); larger ones go through NCCL.
ONE_SHOT_BYTES = 1 << 20
# The bytes of `broadcast_object`'s first message: a decode plan at batch 256 fits (~12 KB).
OBJECT_SLOT = 32 * 1024


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group of `size` ranks (`rank` 0 plans and
    samples; `local_rank`: its index on its own machine, the GPU it uses)."""

    rank: int
    size: int
    local_rank: int
    device_group: Any = field(repr=False)
    cpu_group: Any = field(repr=False)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # Set by `enable_one_shot`: the symmetric buffer, the group's name, and whether torch has
    # the op that copies the input in itself.
    _one_shot: tuple[torch.Tensor, str, bool] | None = field(default=None, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks: `x` itself, summed in place, or (the one-shot path)
        a new tensor; use the result. Small contiguous CUDA tensors (a decode step's hidden
        states) take the one-shot all-reduce when `enable_one_shot` set it up, the rest
        NCCL. Every rank sums the ranks' values in rank order, so all hold the same result."""
        one = self._one_shot
        if (
            one is not None
            and x.dtype == one[0].dtype
            and x.numel() <= one[0].numel()
            and x.is_contiguous()
        ):
            buf, name, copies = one
            view = buf[: x.numel()].view_as(x)
            if copies:
                return torch.ops.symm_mem.one_shot_all_reduce_copy(view, x, "sum", name)
            view.copy_(x)
            return torch.ops.symm_mem.one_shot_all_reduce(view, "sum", name)
        dist.all_reduce(x, group=self.device_group)
        return x

    @property
    def one_shot(self) -> bool:
        """Whether small all-reduces take the one-shot path (`enable_one_shot`)."""
        return self._one_shot is not None

    def enable_one_shot(self, dtype: torch.dtype, device: torch.device, allowed: bool) -> bool:
        """Set up the one-shot all-reduce for tensors of `dtype` up to `ONE_SHOT_BYTES`: a
        buffer every GPU of the group maps (torch's symmetric memory, no NVLink multicast),
        from which each rank reads its peers' values and sums them in one kernel (about 6 us
        at 8 KiB on two H200s against NCCL's 14-21 us in a CUDA graph, measured by
        benchmarks/tensor_parallel.py). Every rank calls this; they agree before each
        collective step (a rank that cannot go on must not leave its peers waiting in one),
        check the result against NCCL once, and fall back to NCCL alone (one log line) where
        it does not run. `allowed` False (turned off, or ranks on several machines, whose
        GPUs cannot map each other's memory) on any rank keeps NCCL on all."""
        ok, why = allowed, "turned off, or the group spans machines"
        buf = None
        if ok:
            try:
                import torch.distributed._symmetric_memory as symm_mem

                size = torch.finfo(dtype).bits // 8
                buf = symm_mem.empty(ONE_SHOT_BYTES // size, dtype=dtype, device=device)
                ok = hasattr(torch.ops.symm_mem, "one_shot_all_reduce")
                why = "" if ok else "this torch has no one-shot all-reduce"
            except Exception as e:  # not in this torch, or not on this machine
                ok, why = False, f"{type(e).__name__}: {e}"
        if not self.all_true(ok):
            return self._fall_back(why)
        try:
            name = self.device_group.group_name
            symm_mem.rendezvous(buf, name)
            x = torch.arange(12, dtype=dtype, device=device).view(3, 4) * (self.rank + 1)
            want = x.clone()
            dist.all_reduce(want, group=self.device_group)
            copies = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy")
            self._one_shot = (buf, name, copies)
            got = self.all_reduce(x)
            torch.cuda.synchronize(device)
            ok = torch.equal(got, want)
            why = "" if ok else "its sum differs from NCCL's"
        except Exception as e:  # not on this machine
            ok, why = False, f"{type(e).__name__}: {e}"
        if not self.all_true(ok):
            return self._fall_back(why)
        if self.is_leader:
            logger.info(
                "all-reduces up to %d KiB: one-shot over symmetric memory; larger: NCCL",
                ONE_SHOT_BYTES // 1024,
            )
        return True

    def _fall_back(self, why: str) -> bool:
        self._one_shot = None
        if self.is_leader:
            why = why or "another rank could not set it up"
            logger.info("one-shot all-reduce not used (%s): NCCL for every all-reduce", why)
        return False

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` ([..., n] each) side by side along the last dimension, rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype), on the device group:
        queued on the device like the model's collectives, nothing waited for."""
        dist.broadcast(x, 0, group=self.device_group)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled, over the host group); the others pass
        nothing. One message of `OBJECT_SLOT` bytes carries the length and, when it fits, the
        whole object (a step's plan), so a plan costs one round trip; a larger one follows in
        a second. Raises `RuntimeError` when a peer is gone."""
        slot = torch.empty(OBJECT_SLOT, dtype=torch.uint8)
        head = slot[:8].view(torch.int64)
        if self.is_leader:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            head[0] = len(data)
            first = data[: OBJECT_SLOT - 8]
            slot[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(slot, 0, group=self.cpu_group)
        size = int(head[0])
        rest = size - (OBJECT_SLOT - 8)
        if rest > 0:
            tail = torch.empty(rest, dtype=torch.uint8)
            if self.is_leader:
                tail.copy_(torch.frombuffer(bytearray(data[OBJECT_SLOT - 8 :]), dtype=torch.uint8))
            dist.broadcast(tail, 0, group=self.cpu_group)
        if self.is_leader:
            return obj
        data = slot[8 : 8 + min(size, OBJECT_SLOT - 8)].numpy().tobytes()
        if rest > 0:
            data += tail.numpy().tobytes()
        return pickle.loads(data)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (over the host group)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def all_true(self, value: bool) -> bool:
        """Whether every rank's `value` is true."""
        return self.min_int(int(bool(value))) == 1

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def init_group(
    rank: int, size: int, local_rank: int, init_addr: str, device: torch.device
) -> TPGroup:
    """Join the group of `size` ranks that meets at `init_addr` ("host:port", rank 0's
    TCP store). NCCL carries the model's collectives on CUDA, gloo elsewhere; the host group
    is always gloo."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # NCCL's heartbeat monitor polls rank 0's TCP store: at every shutdown a follower's
        # outlived the store and logged "Broken pipe" warnings (the two-H200 run). braid
        # notices a failed rank itself (`tp_worker`), so the monitor is off unless asked for.
        os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init_addr}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    cpu_group = (
        dist.group.WORLD
        if backend == "gloo"
        else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    )
    logger.info("tensor-parallel rank %d of %d joined (%s, %s)", rank, size, backend, device)
    return TPGroup(rank, size, local_rank, dist.group.WORLD, cpu_group)


_BUILDING: TPGroup | None = None


@contextlib.contextmanager
def sharding(group: TPGroup | None) -> Iterator[None]:
    """Build a model's parallel layers for `group` (None, or a group of one: whole weights)."""
    global _BUILDING
    previous, _BUILDING = _BUILDING, group if group is not None and group.size > 1 else None
    try:
        yield
    finally:
        _BUILDING = previous


def building_group() -> TPGroup | None:
    """The group a model under construction is split over (None: not split)."""
    return _BUILDING
