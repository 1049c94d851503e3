"""The one owner of a request's KV life: admission (a table row and the cached prefix),
growth, caching what a running request has computed, release, eviction and program-session
pins, and the accounting invariants over all of it.

Every KV page is free, held by exactly one request (its pages past `shared_pages`), or held by
the prefix cache; a request's first `shared_pages` pages are the cache's, locked through its
`cache_node`. Requests' statuses are the scheduler's business: nothing here moves a request
between queues.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from braid.runtime.cache.memory_pool import KVPool, PageAllocator, ReqToTokenPool, slots_of
from braid.runtime.cache.radix_cache import PrefixCache, TreeNode
from braid.runtime.forward_batch import to_device
from braid.runtime.scheduler.programs import program_of
from braid.runtime.scheduler.request import Req
from braid.runtime.scheduler.sessions import SessionPins
from braid.runtime.scheduler.stats import SchedulerStats


class KVManager:
    def __init__(
        self,
        allocator: PageAllocator,
        table: ReqToTokenPool,
        cache: PrefixCache,
        stats: SchedulerStats,
        max_session_pins: int,
        session_ttl_s: float,
        pool: KVPool | None = None,
    ) -> None:
        self.allocator = allocator
        self.pool = pool
        self.table = table
        self.cache = cache
        self.page_size = allocator.page_size
        self.stats = stats
        # Program sessions: the cache path of each running program's state stays locked.
        self.sessions = SessionPins(
            cache, allocator.capacity_pages // 2, max_session_pins, session_ttl_s
        )
        # Told of every request that gives its KV back (a speculative proposer's draft KV goes
        # with it).
        self.on_release: Callable[[Req], None] | None = None
        # How long a finished session request's pin lasts (its program's TTL); None: the
        # sessions' own TTL.
        self.pin_ttl: Callable[[Req], float] | None = None
        # Whether pinning it pays (`pin_cost.PinCost`); None: always.
        self.pin_pays: Callable[[Req], bool] | None = None

    # ---- room -----------------------------------------------------------------------------
    def make_room(self, need: int, release_pins: bool = False) -> bool:
        """Make `need` pages free, evicting unlocked cache pages if necessary, and with
        `release_pins` giving up session pins (the soonest to expire first) when that is not
        enough; whether they are free now."""
        while True:
            short = need - self.allocator.free_pages
            if short > 0:
                freed = self.cache.evict(short)
                self.stats.evicted_tokens += freed * self.page_size
            if self.allocator.free_pages >= need:
                return True
            if not release_pins or not self.sessions.release_soonest():
                return False

    @property
    def room(self) -> int:
        """Pages that are free or could be freed by evicting."""
        return self.allocator.free_pages + self.cache.evictable_pages

    def pages_to_grow(self, req: Req, end: int) -> int:
        return max(0, self.allocator.pages_for(end) - len(req.pages))

    def grow(self, req: Req, pages: int) -> None:
        """Give `req` `pages` more pages (the caller made room)."""
        req.pages += self.allocator.alloc(pages)

    # ---- a request's life -----------------------------------------------------------------
    def admit(self, req: Req, node: TreeNode | None, prefix_pages: list[int]) -> None:
        """Give `req` a table row and the cached prefix `prefix_pages` (locked on `node` by
        the caller)."""
        req.pool_row = self.table.alloc()
        req.cache_node = node
        req.pages = list(prefix_pages)
        req.shared_pages = len(prefix_pages)
        req.kv_len = len(prefix_pages) * self.page_size
        if prefix_pages:
            self.table.write(req.pool_row, 0, self._slots(prefix_pages))
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = min(req.kv_len, req.prompt_len)
            self.stats.prompt_tokens += req.prompt_len
            self.stats.cached_prompt_tokens += req.cached_tokens

    def cache_unfinished(self, req: Req) -> None:
        """Put the whole pages `req` has computed into the prefix cache while it runs, so
        requests admitted next can share them; where another request cached the same tokens
        first, use its pages and free ours."""
        full = req.kv_len // self.page_size
        if full <= req.shared_pages or not self.cache.enabled:
            return
        tokens = req.cache_tokens(full * self.page_size)
        duplicates = set(self.cache.insert(tokens, req.pages[:full]))
        match = self.cache.match_prefix(tokens)
        assert len(match.pages) == full, "an inserted prefix must match in full"
        self.cache.lock(match.node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = match.node
        if duplicates:
            changed = [i for i in range(full) if req.pages[i] != match.pages[i]]
            self.allocator.free([req.pages[i] for i in changed])
            for i in changed:
                req.pages[i] = match.pages[i]
            self.table.write(req.pool_row, 0, self._slots(req.pages[:full]))
        req.shared_pages = full

    def release(self, req: Req, keep_kv: bool = True) -> None:
        """Give a request's KV back: whole pages to the prefix cache (which keeps what it did
        not already hold), the rest to the allocator; unlock its prefix; free its table row; pin
        a finished session request's path where that pays (`pin_pays`). With `keep_kv` False,
        nothing new goes to the cache (the KV of a failed step is suspect)."""
        if req.pool_row is None and not req.pages:
            return
        if self.on_release is not None:
            self.on_release(req)
        full = min(req.kv_len // self.page_size, len(req.pages))
        if not keep_kv:
            full = req.shared_pages
        offered = req.pages[:full]
        duplicates = self.cache.insert(req.cache_tokens(full * self.page_size), offered)
        own = set(req.pages[req.shared_pages :])
        self.allocator.free([p for p in duplicates if p in own] + req.pages[full:])
        pins = req.session_id is not None and not req.session_closed
        if pins and req.finish_reason in ("stop", "length"):
            if self.pin_pays is None or self.pin_pays(req):
                ttl = self.pin_ttl(req) if self.pin_ttl is not None else None
                tokens = req.cache_tokens(full * self.page_size)
                self.sessions.pin(req.session_id, tokens, ttl, program_of(req))
            else:
                self.sessions.close(req.session_id)  # its earlier pin: this call supersedes it
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.pages, req.shared_pages, req.cache_node, req.kv_len = [], 0, None, 0
        if req.pool_row is not None:
            self.table.free(req.pool_row)
            req.pool_row = None

    def place(self, moves: list[tuple[Req, int, list[int]]]) -> None:
        """For each (req, position, slots): copy the K and V held at `slots` (a draft tree's
        kept branch) to `req`'s slots for `position` onwards (its pages hold them), and point
        its table row there."""
        if self.pool is None:
            raise RuntimeError("this KV manager has no pool to copy in")
        ps = self.page_size
        src, dst, rows, positions = [], [], [], []
        for req, start, slots in moves:
            for j, s in enumerate(slots):
                pos = start + j
                src.append(s)
                dst.append(req.pages[pos // ps] * ps + pos % ps)
                rows.append(req.pool_row)
                positions.append(pos)
        self.pool.copy_slots(src, dst)
        self.table.write_at(rows, positions, dst)

    def trim(self, req: Req, kv_len: int | None = None) -> None:
        """Drop the KV past `req`'s sequence (its rejected jump-forward tokens), or past
        `kv_len` tokens: the pages past the kept tokens are freed, never cached. (Work queued
        later on the device may reuse them: the work that wrote them was queued before.)"""
        req.kv_len = req.seq_len if kv_len is None else kv_len
        keep = self.allocator.pages_for(req.kv_len)
        assert keep >= req.shared_pages, "unverified tokens are never cached"
        self.allocator.free(req.pages[keep:])
        del req.pages[keep:]

    def _slots(self, pages: list[int]) -> list[int] | torch.Tensor:
        """Every slot of `pages`, for a table row: at page size 1 the pages themselves, else
        made on the device from the pages (a 32k-token prefix's slots built in Python took
        3.4 ms at page size 16), through pinned memory (a CPU tensor would be a copy that
        waits for the stream)."""
        ps = self.page_size
        if ps == 1:
            return pages
        if self.table.journal is not None:
            # Tensor parallelism journals the row's slots for the other ranks: made here on the
            # host, not read back from the device (a read-back waits for the stream).
            return slots_of(pages, ps, 0, len(pages) * ps)
        p = to_device(pages, self.table.table.device)
        return (p[:, None] * ps + torch.arange(ps, device=p.device)[None, :]).reshape(-1)

    # ---- the pool as a whole --------------------------------------------------------------
    def usage(self) -> dict[str, float]:
        cap = self.allocator.capacity_pages
        used = cap - self.allocator.free_pages - self.cache.evictable_pages
        return {
            "kv_capacity_tokens": float(self.allocator.capacity_tokens),
            "kv_free_tokens": float(self.allocator.free_pages * self.page_size),
            "kv_cached_tokens": float(self.cache.total_pages * self.page_size),
            "kv_usage": used / cap,
            "pinned_sessions": float(len(self.sessions)),
            "pinned_programs": float(len(self.sessions.by_program())),
            "pinned_tokens": float(self.sessions.pinned_pages * self.page_size),
            "pins_expired": float(self.sessions.expired),
            "pins_released_for_room": float(self.sessions.released_for_room),
        }

    def pinned_by_program(self) -> dict[str, tuple[int, int]]:
        """Per program holding pins: (tokens pinned, sessions pinned)."""
        ps = self.page_size
        return {p: (pages * ps, n) for p, (pages, n) in self.sessions.by_program().items()}

    def flush(self) -> None:
        """Release every session pin and empty the prefix cache (nothing may hold a lock)."""
        self.sessions.close_all()
        self.stats.evicted_tokens += self.cache.total_pages * self.page_size
        self.cache.reset()

    def check_invariants(self, active: list[Req], idle: list[Req]) -> None:
        """Every KV page is free, held by exactly one `active` request, or held by the cache;
        every cache lock is held by exactly one active request's prefix or session pin; `idle`
        requests hold nothing."""
        self.cache.check_invariants()
        free = self.allocator.free_page_set()
        assert len(free) == self.allocator.free_pages, "a page is on the free list twice"
        owned = [p for r in active for p in r.pages[r.shared_pages :]]
        cached = self.cache.cached_pages()
        everything = list(free) + owned + cached
        assert len(everything) == len(set(everything)), "a KV page has two owners"
        assert len(everything) == self.allocator.capacity_pages, (
            f"KV pages leaked: free {len(free)} + requests {len(owned)} + cache {len(cached)} "
            f"!= capacity {self.allocator.capacity_pages}"
        )
        cached_set = set(cached)
        for r in active:
            assert set(r.pages[: r.shared_pages]) <= cached_set, "shared page not in the cache"
            assert len(r.pages) == self.allocator.pages_for(r.kv_len), "pages != kv length"
        holders = [r.cache_node for r in active if r.cache_node is not None]
        self.cache.check_locks(holders + self.sessions.nodes())
        pins = self.sessions
        assert len(pins) <= pins.max_sessions, "more sessions pinned than allowed"
        assert pins.pinned_pages <= pins.max_pages, "pins hold more pages than allowed"
        rows = [r.pool_row for r in active]
        assert None not in rows and len(set(rows)) == len(rows)
        assert self.table.free_slots + len(rows) == self.table.size, "table rows leaked"
        assert all(r.pool_row is None and not r.pages for r in idle), "a queued request holds KV"
