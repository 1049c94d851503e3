"""Program sessions: the prefix-cache path a running program's state occupies, kept locked
between its requests so eviction cannot take it.

Any client can name a session, so pins are bounded three ways: all pins together hold at most
`max_pages` pages (half the pool), one session at most half of that, and at most
`max_sessions` sessions are pinned (pinning one more releases the least recently used). A pin
also expires after its TTL: `ttl_s`, or the one its pin asks for (a program's, adapted to its
tool calls: `programs.ProgramTable.pin_ttl`). Pins are the KV that goes first after the
unpinned cache: the scheduler releases them, the soonest to expire first, before it retracts
a running request, and one at a time until the first waiting request in policy order fits
(`release_soonest`; `prefill.PrefillPlanner._pins_give_way`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from braid.runtime.cache.radix_cache import PrefixCache, TreeNode


class SessionPins:
    """One locked cache node per session, least recently pinned first."""

    def __init__(
        self,
        cache: PrefixCache,
        max_pages: int,
        max_sessions: int = 64,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions < 1 or not ttl_s > 0:
            raise ValueError(
                f"session pins need max_sessions >= 1 and ttl_s > 0, got {max_sessions}, {ttl_s}"
            )
        self.cache = cache
        self.max_pages = max_pages
        self.max_session_pages = max(1, max_pages // 2)
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.clock = clock
        # session -> (locked node, pages, expiry time, program)
        self._pins: OrderedDict[str, tuple[TreeNode, int, float, str]] = OrderedDict()
        self.expired = 0  # pins that reached their TTL
        self.released_for_room = 0  # pins given up to keep running requests going

    def pin(
        self,
        session: str,
        tokens: list[int],
        ttl_s: float | None = None,
        program: str | None = None,
    ) -> None:
        """Lock `tokens`' cached path for `session` (whole pages already in the cache) for
        `ttl_s` (default: the table's), replacing the session's previous pin; the pin is
        counted for `program` (default: the session's root, as `programs.program_of`). A path
        past the per-session or total limit is not pinned (the old pin is still released)."""
        self.expire()
        match = self.cache.match_prefix(tokens)
        old = self._pins.pop(session, None)
        pages = len(match.pages)
        if pages and pages <= self.max_session_pages:
            while self._pins and (
                len(self._pins) >= self.max_sessions or self.pinned_pages + pages > self.max_pages
            ):
                self.close(next(iter(self._pins)))  # the least recently used goes first
            self.cache.lock(match.node)
            ttl = self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s)
            owner = program if program is not None else session.split(".", 1)[0]
            self._pins[session] = (match.node, pages, self.clock() + ttl, owner)
        if old is not None:
            self.cache.unlock(old[0])

    def expire(self) -> int:
        """Release the pins past their TTL; how many."""
        now = self.clock()
        stale = [s for s, (_, _, until, _) in self._pins.items() if until < now]
        for s in stale:
            self.close(s)
        self.expired += len(stale)
        return len(stale)

    def release_soonest(self, keep: Callable[[str], bool] | None = None) -> bool:
        """Release the pin that would expire first (to make room), of those whose program
        `keep` does not keep; whether there was one."""
        pins = [s for s, pin in self._pins.items() if keep is None or not keep(pin[3])]
        if not pins:
            return False
        self.close(min(pins, key=lambda s: self._pins[s][2]))
        self.released_for_room += 1
        return True

    def close(self, session: str) -> bool:
        """Release `session`'s pin; whether it had one."""
        old = self._pins.pop(session, None)
        if old is not None:
            self.cache.unlock(old[0])
        return old is not None

    def close_forks(self, root: str) -> int:
        """Release the pins of `root`'s forks (sessions "<root>.<i>", and theirs); how many."""
        forks = [s for s in self._pins if s.startswith(root + ".")]
        for session in forks:
            self.close(session)
        return len(forks)

    def close_all(self) -> None:
        for session in list(self._pins):
            self.close(session)

    def nodes(self) -> list[TreeNode]:
        """The pinned nodes (each holds one lock on its path)."""
        return [node for node, _, _, _ in self._pins.values()]

    def by_program(self) -> dict[str, tuple[int, int]]:
        """Per program holding pins: (pages pinned, sessions pinned)."""
        out: dict[str, tuple[int, int]] = {}
        for _, pages, _, program in self._pins.values():
            held, sessions = out.get(program, (0, 0))
            out[program] = (held + pages, sessions + 1)
        return out

    def releasable_pages(self, keep: Callable[[str], bool] | None = None) -> int:
        """Pages that releasing every pin (but those whose program `keep` keeps) would make
        evictable: those of pinned nodes (and their ancestors) that nothing but the released
        pins holds (a running request's prefix and a kept pin's path stay)."""
        pins_on: dict[int, int] = {}
        nodes: dict[int, TreeNode] = {}
        released = [n for n, _, _, p in self._pins.values() if keep is None or not keep(p)]
        for node in released:
            while node is not None and node.parent is not None:  # up to, not into, the root
                pins_on[id(node)] = pins_on.get(id(node), 0) + 1
                nodes[id(node)] = node
                node = node.parent
        return sum(len(n.pages) for k, n in nodes.items() if n.lock_ref == pins_on[k])

    @property
    def pinned_pages(self) -> int:
        return sum(pages for _, pages, _, _ in self._pins.values())

    def __len__(self) -> int:
        return len(self._pins)
