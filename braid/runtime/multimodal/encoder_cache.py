"""Vision-tower outputs by image content hash, so a repeated image, a retracted request or the
next chunk of a prompt never re-encodes (the executor's `embed_with_images` reads it)."""

from __future__ import annotations

import time
from collections import OrderedDict

import torch


class EncoderCache:
    """Outputs of the vision tower ([num_tokens, hidden] each) by image hash; past `max_bytes`
    the least recently used are dropped (an entry larger than the whole budget is still kept
    until the next insertion, so the forward that needs it has it)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self.images_encoded = 0  # images the tower ran on
        self.hits = 0  # images a forward needed that were already here
        self._seconds = 0.0  # in the tower, on the device (CUDA events) or the host clock
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed(self, device: torch.device, fn):
        """`fn()`, its time added to `seconds`; on CUDA measured with events, read later, so
        nothing waits for the device here."""
        if device.type != "cuda":
            t0 = time.perf_counter()
            out = fn()
            self._seconds += time.perf_counter() - t0
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        self._pending.append((start, end))
        while self._pending and self._pending[0][1].query():
            a, b = self._pending.pop(0)
            self._seconds += a.elapsed_time(b) / 1e3
        return out

    @property
    def seconds(self) -> float:
        """Time spent in the vision tower by the encodes that have finished (never waits: the
        scheduler's stats, read between steps, ask for it)."""
        while self._pending and self._pending[0][1].query():
            a, b = self._pending.pop(0)
            self._seconds += a.elapsed_time(b) / 1e3
        return self._seconds

    def get(self, key: int) -> torch.Tensor | None:
        out = self._entries.get(key)
        if out is not None:
            self._entries.move_to_end(key)
        return out

    def put(self, key: int, out: torch.Tensor) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.numel() * old.element_size()
        while self._entries and self.nbytes + out.numel() * out.element_size() > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.nbytes -= dropped.numel() * dropped.element_size()
        self._entries[key] = out
        self.nbytes += out.numel() * out.element_size()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
