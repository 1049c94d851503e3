"""Program sessions: the prefix-cache path a running program's state occupies, kept locked
between its requests so eviction cannot take it."""

from __future__ import annotations

from braid.runtime.cache.radix_cache import PrefixCache, TreeNode


class SessionPins:
    """One locked cache node per session. Pins never hold more than `max_pages` pages in
    total: past that, a session's newest state is simply not pinned (its old pin is still
    released)."""

    def __init__(self, cache: PrefixCache, max_pages: int) -> None:
        self.cache = cache
        self.max_pages = max_pages
        self._pins: dict[str, tuple[TreeNode, int]] = {}

    def pin(self, session: str, tokens: list[int]) -> None:
        """Lock `tokens`' cached path for `session` (whole pages already in the cache),
        replacing the session's previous pin."""
        match = self.cache.match_prefix(tokens)
        old = self._pins.pop(session, None)
        if match.pages and self.pinned_pages + len(match.pages) <= self.max_pages:
            self.cache.lock(match.node)
            self._pins[session] = (match.node, len(match.pages))
        if old is not None:
            self.cache.unlock(old[0])

    def close(self, session: str) -> bool:
        """Release `session`'s pin; whether it had one."""
        old = self._pins.pop(session, None)
        if old is not None:
            self.cache.unlock(old[0])
        return old is not None

    def close_all(self) -> None:
        for session in list(self._pins):
            self.close(session)

    def nodes(self) -> list[TreeNode]:
        """The pinned nodes (each holds one lock on its path)."""
        return [node for node, _ in self._pins.values()]

    @property
    def pinned_pages(self) -> int:
        return sum(pages for _, pages in self._pins.values())

    def __len__(self) -> int:
        return len(self._pins)
