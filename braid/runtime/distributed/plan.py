"""What rank 0 sends the other tensor-parallel ranks: the plan of every forward, not its
tensors.

Rank 0's scheduler plans every step alone (admission, prefix matches, KV pages, retraction
are host-side bookkeeping no other rank keeps). What the other ranks need to run the same
forward over their heads is (1) the writes rank 0 made since the last forward to the two
device structures every rank holds a copy of, the request-to-token table and the KV pool
(`ReqToTokenPool.journal`, `KVPool.journal`: table rows filled, KV slots copied), and (2) the
forward batch's host values. `PlanSender.forward` sends both, over the group's host (gloo)
group, before rank 0's own forward; each follower applies the writes in order and runs the
same forward (`follow`), meeting rank 0 in the model's collectives. Sampling, grammars and
outputs are rank 0's alone: every rank gathers the logits, only rank 0 reads them.

While idle, rank 0 sends a tick every `IDLE_TICK_S`, so a rank that died is noticed within
seconds even with no traffic (the send fails), and followers never wait long on a live rank 0.
`check` compares every rank's table with rank 0's (`check_invariants` on every rank).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import torch

from braid.runtime.distributed.group import TPGroup
from braid.runtime.forward_batch import ForwardBatch, ForwardMode, to_device

logger = logging.getLogger(__name__)

IDLE_TICK_S = 1.0

# ForwardBatch fields sent as host lists (everything a text model's forward reads).
_TENSORS = (
    "input_ids",
    "positions",
    "out_cache_loc",
    "req_pool_indices",
    "seq_lens",
    "logits_indices",
)


def encode_batch(batch: ForwardBatch) -> dict[str, Any]:
    """`batch`'s host values. Refuses what tensor parallelism does not carry (images, draft
    trees, hidden-state capture: the engine refuses them at start)."""
    if batch.images or batch.mrope_positions is not None or batch.tree_tail is not None:
        raise RuntimeError("tensor parallelism carries text forwards only")
    if batch.capture_hidden or batch.aux_layers:
        raise RuntimeError("tensor parallelism does not capture hidden states")
    # The builder's host values where it kept them: a tensor's `.tolist()` waits for the
    # device, which would stall an overlapped decode behind the step before it.
    host = batch.host or {}
    out: dict[str, Any] = {
        name: host[name] if name in host else getattr(batch, name).tolist()
        for name in _TENSORS
        if name != "input_ids" or batch.sample_rows is None
    }
    if batch.sample_rows is not None:
        out["sample_rows"] = list(batch.sample_rows)
    out["mode"] = batch.mode.value
    out["prefix_lens"] = list(batch.prefix_lens)
    out["extend_lens"] = list(batch.extend_lens)
    out["decode_tail"] = batch.decode_tail
    return out


def decode_batch(
    d: dict[str, Any], device: torch.device, samples: torch.Tensor | None = None
) -> ForwardBatch:
    """The forward batch `encode_batch` described; a decode fed by the previous decode's
    samples takes its `sample_rows` of `samples` (this rank's copy of rank 0's, `follow`)."""
    tensors = {name: to_device(d[name], device) for name in _TENSORS if name in d}
    rows = d.get("sample_rows")
    if rows is not None:
        if samples is None:
            raise RuntimeError("a tensor-parallel plan reads samples no decode has shared")
        # Ascending rows of the samples (`overlap.next_step`): all of them iff as many.
        every = len(rows) == samples.shape[0]
        tensors["input_ids"] = samples if every else samples[to_device(rows, device)]
    return ForwardBatch(
        mode=ForwardMode(d["mode"]),
        prefix_lens=d["prefix_lens"],
        extend_lens=d["extend_lens"],
        decode_tail=d.get("decode_tail", 0),
        **tensors,
    )


def table_digest(table: torch.Tensor) -> str:
    return hashlib.sha256(table.cpu().numpy().tobytes()).hexdigest()


class PlanSender:
    """Rank 0's side: `journal` is the list the runner's table and KV pool record into.

    With `share_samples` (the overlap schedule), every decode's samples are broadcast to the
    other ranks on the device once rank 0 has sampled them (`share`), and each follower
    receives them after its forward of that decode: a decode queued before the previous one
    is read back names the rows of those samples it takes as input (`sample_rows`), which no
    rank's host has seen."""

    def __init__(self, group: TPGroup, table: torch.Tensor, share_samples: bool = False) -> None:
        assert group.is_leader
        self.group = group
        self.table = table
        self.share_samples = share_samples
        self.journal: list[tuple] = []
        self._sent_at = time.monotonic()
        self.stopped = False

    def _send(self, msg: tuple) -> None:
        self.group.broadcast_object(msg)
        self._sent_at = time.monotonic()

    def forward(self, batch: ForwardBatch) -> None:
        """Send the writes so far and `batch`; rank 0 runs it next, as every rank does."""
        writes, self.journal[:] = list(self.journal), []
        plan = encode_batch(batch)
        plan["share"] = self.share_samples and batch.mode is ForwardMode.DECODE
        self._send(("forward", writes, plan))

    def share(self, next_ids: torch.Tensor) -> None:
        """A decode's samples ([B] int64 on the device) to every rank, queued behind the
        sampling; every decode `forward` sent with sharing on must be followed by this."""
        if self.share_samples:
            self.group.broadcast(next_ids.to(torch.int64).contiguous())

    def tick(self) -> None:
        """While idle: tell the ranks rank 0 is alive (and learn whether they are: the send
        raises when one is gone), at most every IDLE_TICK_S."""
        if time.monotonic() - self._sent_at >= IDLE_TICK_S:
            writes, self.journal[:] = list(self.journal), []
            self._send(("tick", writes))

    def check(self) -> None:
        """Every rank's request-to-token table equals rank 0's (after the pending writes);
        `AssertionError` naming the disagreement."""
        writes, self.journal[:] = list(self.journal), []
        self._send(("check", writes, table_digest(self.table)))
        assert self.group.all_true(True), "a tensor-parallel rank's request-to-token table differs"

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self._send(("stop",))


def apply_writes(writes: list[tuple], table: Any, kv_pool: Any) -> None:
    """Replay rank 0's table and KV writes on this rank's copies, in order."""
    for w in writes:
        if w[0] == "row":
            table.write(w[1], w[2], w[3])
        elif w[0] == "at":
            table.write_at(w[1], w[2], w[3])
        elif w[0] == "copy":
            kv_pool.copy_slots(w[1], w[2])
        else:
            raise RuntimeError(f"unknown write {w[0]!r} in a tensor-parallel plan")


def follow(runner: Any, group: TPGroup) -> str:
    """A follower's loop: receive rank 0's plans and run them, until rank 0 says stop
    (returns "stop") or is gone (the group's error propagates)."""
    forwards = 0
    samples: torch.Tensor | None = None  # the last shared decode's, as rank 0 sampled them
    while True:
        msg = group.broadcast_object()
        kind = msg[0]
        if kind == "stop":
            logger.info("tensor-parallel rank %d: stop after %d forwards", group.rank, forwards)
            return "stop"
        apply_writes(msg[1], runner.req_to_token, runner.kv_pool)
        if kind == "forward":
            plan = msg[2]
            batch = decode_batch(plan, runner.device, samples)
            runner.forward(batch)
            forwards += 1
            if plan.get("share"):
                rows = len(plan["extend_lens"])
                samples = torch.empty(rows, dtype=torch.int64, device=runner.device)
                group.broadcast(samples)
        elif kind == "check":
            same = table_digest(runner.req_to_token.table) == msg[2]
            if not same:
                logger.error("tensor-parallel rank %d: request-to-token table differs", group.rank)
            group.all_true(same)
        elif kind != "tick":
            raise RuntimeError(f"unknown tensor-parallel plan {kind!r}")
