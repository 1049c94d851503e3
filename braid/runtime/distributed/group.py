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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place; returns `x`."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` ([..., n] each) side by side along the last dimension, rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled, over the host group); the others pass
        nothing. Raises `RuntimeError` when a peer is gone."""
        if self.is_leader:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.cpu_group)
        if self.is_leader:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.cpu_group)
        return obj if self.is_leader else pickle.loads(buf.numpy().tobytes())

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
