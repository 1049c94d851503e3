"""KV memory: the token-to-KV pool, its page allocator, and the request-to-token table.

Layout: KV slots are grouped in pages of `page_size` slots; slot `s` lives in page
`s // page_size`. Page 0 is never handed out: its slots are the padding target that batched
kernels may read or write harmlessly. A request's KV is the list of pages it holds; the
request-to-token table maps (request slot, position) to the KV slot of that token, which is
what attention reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from braid.kernels.reference import (
    KV_FP8_DTYPE,
    dequantize_kv_reference,
    kv_inverse_scale,
    quantize_kv_reference,
)
from braid.runtime.forward_batch import to_device


class PageAllocator:
    """Hands out whole pages of KV slots. Free pages are kept in a LIFO list (hot pages reused)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"KV pool needs at least 2 pages, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        # Page 0 is the padding page; the usable capacity is pages 1 .. num_pages-1.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))

    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """`n` pages, or None (and nothing taken) when fewer than `n` are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()  # ascending: a fresh pool gives a sequence one run of slots
        return out

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))  # `alloc` gives them back in this order

    def free_page_set(self) -> set[int]:
        return set(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


class KVPool:
    """Per-layer K and V buffers of shape [num_pages * page_size, kv_heads, head_dim].

    `dtype` is the buffers' dtype: the model's, or `torch.float8_e4m3fn` for an fp8 KV cache
    (one byte a value). Then each layer has a K and a V scale (`k_scales`, `v_scales`: a
    checkpoint's, through `ModelRunner`; 1.0 each when not given): a row is stored as
    clamp(x * (1 / scale), +-448) cast to e4m3 (`quantize_kv_reference`) and read back as its
    float32 value times the scale (`dequantize_kv_reference`). Every write and read of the pool
    goes through these: `store`, `read`, `copy_slots` (which copies bytes), and the Triton
    kernels given `scales(layer)`."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
    ) -> None:
        self.allocator = PageAllocator(num_pages, page_size)
        self.dtype = dtype
        self.quantized = dtype == KV_FP8_DTYPE
        if not self.quantized and (k_scales is not None or v_scales is not None):
            raise ValueError(f"KV scales are for an fp8 KV cache, not {dtype}")
        self.k_scales = self._scales("k_scales", k_scales, num_layers)
        self.v_scales = self._scales("v_scales", v_scales, num_layers)
        slots = num_pages * page_size
        # torch.empty: zero-filling would touch every byte of a pool that may be many GB. Slots
        # are written before they are read, except the padding page, which must hold finite
        # values (a masked-out key still enters the matmul), so it alone is zeroed (0 is a
        # finite e4m3 value too).
        self.k = [
            torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.v = [
            torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        for buf in self.k + self.v:
            buf[:page_size].zero_()
        # Under tensor parallelism, rank 0's writes outside a forward, for the other ranks
        # (`distributed.plan`); None: not recorded.
        self.journal: list[tuple] | None = None

    @staticmethod
    def _scales(name: str, given: Sequence[float] | None, num_layers: int) -> list[float]:
        if given is None:
            return [1.0] * num_layers
        scales = [float(s) for s in given]
        if len(scales) != num_layers:
            raise ValueError(f"{name} has {len(scales)} entries, expected {num_layers} (a layer)")
        for s in scales:
            kv_inverse_scale(s)  # ValueError for a scale that is not positive and finite
        return scales

    def scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of `layer`: what the kernels multiply stored values by (1.0, 1.0
        for a float cache)."""
        return self.k_scales[layer], self.v_scales[layer]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """K[dst] = K[src] and V[dst] = V[src] in every layer (`dst` distinct from `src`); the
        stored bytes are copied, so fp8 values are not requantized."""
        if self.journal is not None:
            self.journal.append(("copy", list(src), list(dst)))
        device = self.k[0].device
        index = torch.tensor([src, dst], dtype=torch.int64).to(device, non_blocking=True)
        for buf in self.k + self.v:
            # index_copy_ has no float8 kernel on CPU: fp8 buffers are copied as bytes.
            raw = buf.view(torch.uint8) if self.quantized else buf
            raw.index_copy_(0, index[1], raw.index_select(0, index[0]))

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rows `k`, `v` ([n, kv_heads, head_dim]) of `layer` at slots `loc`, quantized
        for an fp8 cache."""
        if self.quantized:
            k = quantize_kv_reference(k, self.k_scales[layer])
            v = quantize_kv_reference(v, self.v_scales[layer])
        self.k[layer][loc] = k
        self.v[layer][loc] = v

    def read(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` at `slots` (int64 [n]), in `dtype`: [n, kv_heads, head_dim] each,
        dequantized for an fp8 cache (index_select: several times faster on CPU than advanced
        indexing)."""
        k = self.k[layer].index_select(0, slots)
        v = self.v[layer].index_select(0, slots)
        if not self.quantized:
            return k, v
        k_scale, v_scale = self.scales(layer)
        return dequantize_kv_reference(k, k_scale, dtype), dequantize_kv_reference(
            v, v_scale, dtype
        )


class ReqToTokenPool:
    """A [max_requests, max_context] table of KV slot indices, one row per running request."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device) -> None:
        self.table = torch.zeros(max_requests, max_context, dtype=torch.int64, device=device)
        self._free = list(range(max_requests - 1, -1, -1))
        self.size = max_requests
        # As `KVPool.journal`: every write, recorded for the other tensor-parallel ranks.
        self.journal: list[tuple] | None = None

    def write(
        self,
        row: int,
        start: int,
        slots: Sequence[int] | torch.Tensor,
        on_device: torch.Tensor | None = None,
    ) -> None:
        """Positions [start, start + len(slots)) of table row `row` hold `slots`;
        `on_device`: the same slots already on the table's device (a batch builder's packed
        copy). A list goes to the device through pinned memory (`to_device`)."""
        if isinstance(slots, torch.Tensor):
            on_device = slots
        if self.journal is not None:
            host = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
            self.journal.append(("row", row, start, host))
        if on_device is None:
            on_device = to_device(slots, self.table.device)
        self.table[row, start : start + len(slots)] = on_device

    def write_runs(
        self,
        rows: Sequence[int],
        starts: Sequence[int],
        lens: Sequence[int],
        slots: list[int],
        on_device: torch.Tensor,
    ) -> None:
        """Row `rows[i]`'s positions [starts[i], starts[i] + lens[i]) hold the next lens[i] of
        `slots` (an extend's new tokens, request after request), from `on_device`, the same
        slots already on the table's device."""
        done = 0
        for row, start, n in zip(rows, starts, lens):
            self.write(row, start, slots[done : done + n], on_device=on_device[done : done + n])
            done += n

    def write_at(
        self,
        rows: list[int],
        positions: list[int],
        slots: list[int],
        on_device: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """table[rows[i], positions[i]] = slots[i]; `on_device`: the three already on the
        table's device (a batch builder's packed copy)."""
        if self.journal is not None:
            self.journal.append(("at", list(rows), list(positions), list(slots)))
        if on_device is None:
            on_device = tuple(to_device(v, self.table.device) for v in (rows, positions, slots))
        r, p, s = on_device
        self.table[r, p] = s

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)


class SlotHolder(Protocol):
    """What holds KV pages and a row of the request-to-token table."""

    pages: list[int]
    kv_len: int
    pool_row: int | None


def grow(holder: SlotHolder, end: int, allocator: PageAllocator) -> None:
    """Give `holder` the pages positions up to `end` need (the caller made room)."""
    need = allocator.pages_for(end) - len(holder.pages)
    if need > 0:
        pages = allocator.alloc(need)
        assert pages is not None, "no free KV pages: room must be made first"
        holder.pages.extend(pages)


def assign_slots(req: SlotHolder, new_len: int, allocator: PageAllocator) -> list[int]:
    """Give positions [req.kv_len, new_len) KV slots, growing the request's pages; the caller
    records them in its table row (`build_extend`, from its one copy to the device) and has
    made sure the pages are free."""
    grow(req, new_len, allocator)
    return slots_of(req.pages, allocator.page_size, req.kv_len, new_len)


def slots_of(pages: list[int], page_size: int, start: int, end: int) -> list[int]:
    """The KV slots of positions [start, end) of a sequence holding `pages`."""
    assert end <= len(pages) * page_size, "positions past the sequence's pages"
    if page_size == 1:
        return pages[start:end]
    return [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
