"""The prefix cache: a radix tree over token ids whose edges hold KV pages.

Every node's edge holds a whole number of pages: `key` is `len(pages) * page_size` token ids and
`pages` the KV pages that hold them, so matches and inserts are page-aligned. A node's
`lock_ref` counts the running requests whose cached prefix ends in its subtree; a locked node
is never evicted. Unlocked leaves are evicted least recently used first.

Eviction pops a heap of candidate leaves (`_heap`), each pushed when it may have become an
unlocked leaf (inserted, unlocked, its last child evicted) and checked when popped (still in the
tree, a leaf, unlocked, not used since: else dropped or pushed again at its new time), so an
eviction costs what it evicts, not a walk over the whole tree: with 4000 cached requests the
walk took 5.3 ms a call on a 2-core VM, and on the H200 a cache this full made every admission
pay it (docs/benchmarks.md: Structured outputs on the H200, 2026-12-03).

Ownership: a page is free (in the allocator), held by exactly one running request, or held by
exactly one tree node. `PrefixCache` is the interface the scheduler uses; `NoPrefixCache` is
the same interface with caching off (`disable_radix_cache`).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from braid.runtime.cache.memory_pool import PageAllocator


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items `a` and `b` (two lists, or two arrays) share: slices compared
    whole, in C, and a mismatch found by bisection, never item by item in Python."""
    n = min(len(a), len(b))
    if (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class MatchResult:
    """`pages` hold the first `len(pages) * page_size` tokens; `node` is where they end (lock it
    to keep them)."""

    pages: list[int]
    node: TreeNode


class PrefixCache(ABC):
    """What the scheduler needs from a prefix cache. All lengths are in tokens."""

    page_size: int

    @abstractmethod
    def match_prefix(self, tokens: list[int]) -> MatchResult: ...

    @abstractmethod
    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Offer `pages` (holding `tokens`, page-aligned) to the cache. Returns the offered
        pages the cache did not adopt because it already holds the same tokens in other
        pages; the caller still owns (and must free or keep) those."""

    @abstractmethod
    def lock(self, node: TreeNode) -> None: ...

    @abstractmethod
    def unlock(self, node: TreeNode) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unlocked pages; returns how many were freed."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int: ...

    @property
    @abstractmethod
    def total_pages(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Free every cached page. Only valid while nothing is locked."""

    @abstractmethod
    def cached_pages(self) -> list[int]:
        """Every page the cache holds (locked or not)."""

    @abstractmethod
    def check_invariants(self) -> None: ...

    @abstractmethod
    def check_locks(self, holders: list[TreeNode]) -> None:
        """Assert that each node's lock count is the number of `holders` (one entry per lock
        taken with `lock`, the node it was taken on) whose path runs through it."""

    @property
    def enabled(self) -> bool:
        """Whether the cache adopts what is inserted (False: caching is off)."""
        return True

    @property
    def root(self) -> TreeNode:
        return self._root


class NoPrefixCache(PrefixCache):
    """Caching off: nothing matches, nothing is adopted."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._root = TreeNode()

    def match_prefix(self, tokens: list[int]) -> MatchResult:
        return MatchResult([], self._root)

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        return list(pages)

    def lock(self, node: TreeNode) -> None:
        pass

    def unlock(self, node: TreeNode) -> None:
        pass

    def evict(self, num_pages: int) -> int:
        return 0

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def total_pages(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def cached_pages(self) -> list[int]:
        return []

    def check_invariants(self) -> None:
        assert not self._root.children

    def check_locks(self, holders: list[TreeNode]) -> None:
        assert all(h is self._root for h in holders), "a lock on a node caching-off never made"

    @property
    def enabled(self) -> bool:
        return False


class RadixCache(PrefixCache):
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._root = TreeNode()
        self._root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self._evictable = 0  # pages in nodes with lock_ref == 0
        self._total = 0
        self.evicted_pages = 0  # lifetime counter, for stats
        # Eviction candidates: (last_access when pushed, push order, node), checked when popped.
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._pushes = itertools.count()
        self.heap_rebuilds = 0  # candidates rebuilt from the whole tree (stale entries piled up)

    # ---- helpers --------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _page_key(self, tokens: list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _matched_pages(self, node: TreeNode, tokens: list[int], start: int) -> int:
        """How many whole pages of `node.key` equal `tokens[start:]` (`common_prefix_len`:
        comparing page by page in Python cost ~0.15 us a token, 38 ms for 256 lookups of ~1k
        tokens, paid by lpm and the program policy at every admission)."""
        ps = self.page_size
        end = min(len(node.key), len(tokens) - start) // ps * ps
        return common_prefix_len(node.key[:end], tokens[start : start + end]) // ps

    def _split(self, node: TreeNode, pages: int) -> TreeNode:
        """Split `node`'s edge after `pages` pages; returns the new upper node."""
        cut = pages * self.page_size
        upper = TreeNode(
            key=node.key[:cut],
            pages=node.pages[:pages],
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        upper.children = {self._page_key(node.key, cut): node}
        node.parent.children[self._page_key(upper.key, 0)] = upper
        node.parent = upper
        node.key = node.key[cut:]
        node.pages = node.pages[pages:]
        return upper

    # ---- interface ------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int]) -> MatchResult:
        """The longest cached page-aligned prefix of `tokens`.

        Side effects: marks the matched nodes as recently used, and **splits** a node whose
        edge matches only partly, so that the result ends exactly at a node (which the caller
        can lock). Splitting changes no page's ownership and no cached content.
        """
        now = self._tick()
        node = self._root
        pages: list[int] = []
        pos = 0
        while len(tokens) - pos >= self.page_size:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            m = self._matched_pages(child, tokens, pos)
            if m < len(child.pages):
                child = self._split(child, m)
            child.last_access = now
            pages += child.pages
            pos += m * self.page_size
            node = child
        return MatchResult(pages, node)

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        ps = self.page_size
        assert len(tokens) == len(pages) * ps, "insert takes whole pages"
        now = self._tick()
        node = self._root
        pos = 0
        duplicates: list[int] = []
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                leaf = TreeNode(
                    key=tokens[pos:], pages=pages[pos // ps :], parent=node, last_access=now
                )
                node.children[self._page_key(tokens, pos)] = leaf
                self._total += len(leaf.pages)
                self._evictable += len(leaf.pages)
                self._offer(leaf)
                break
            m = self._matched_pages(child, tokens, pos)
            if m < len(child.pages):
                child = self._split(child, m)
            child.last_access = now
            offered = pages[pos // ps : pos // ps + m]
            if offered != child.pages:  # mostly equal: the inserter matched these pages
                duplicates += [p for p, q in zip(offered, child.pages) if p != q]
            pos += m * ps
            node = child
        return duplicates

    def lock(self, node: TreeNode) -> None:
        while node is not None and node is not self._root:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not None and node is not self._root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.pages)
                self._offer(node)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages (fewer if not that many are evictable), unlocked
        leaves least recently used first; returns how many were freed."""
        if len(self._heap) > 2 * self._total + 64:
            self._rebuild()  # mostly stale entries (nodes locked, grown or used again)
        freed, rebuilt = 0, False
        while freed < num_pages and self._evictable:
            if not self._heap:
                if rebuilt:
                    break
                self._rebuild()  # a leaf never offered: not expected, but never lose pages
                rebuilt = True
                continue
            access, _, leaf = heapq.heappop(self._heap)
            if leaf.parent is None or not leaf.is_leaf or leaf.lock_ref:
                continue  # evicted already, grown a child, or locked: unlocking offers it again
            if access != leaf.last_access:
                self._offer(leaf)  # used since it was pushed: its turn comes later
                continue
            parent = leaf.parent
            del parent.children[self._page_key(leaf.key, 0)]
            leaf.parent = None
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self._total -= len(leaf.pages)
            self._evictable -= len(leaf.pages)
            if parent is not self._root:
                self._offer(parent)
        self.evicted_pages += freed
        return freed

    def _offer(self, node: TreeNode) -> None:
        """Make `node` an eviction candidate if it is an unlocked leaf now."""
        if node.lock_ref == 0 and node.is_leaf:
            heapq.heappush(self._heap, (node.last_access, next(self._pushes), node))

    def _rebuild(self) -> None:
        self.heap_rebuilds += 1
        self._heap = [(n.last_access, next(self._pushes), n) for n in self._leaves()]
        self._heap = [e for e in self._heap if e[2].lock_ref == 0]
        heapq.heapify(self._heap)

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self._root]
        while stack:
            n = stack.pop()
            if n.is_leaf and n is not self._root:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def total_pages(self) -> int:
        return self._total

    def reset(self) -> None:
        assert all(n.lock_ref == 0 for n in self._nodes()), "reset while requests hold the cache"
        for n in self._nodes():
            self.allocator.free(n.pages)
        self.evicted_pages += self._total
        self._root.children = {}
        self._total = self._evictable = 0
        self._heap = []

    def cached_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def check_locks(self, holders: list[TreeNode]) -> None:
        expected: dict[int, int] = {}
        for node in holders:
            while node is not None and node is not self._root:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node in self._nodes():
            assert node.lock_ref == expected.get(id(node), 0), "lock count off"

    def check_invariants(self) -> None:
        """Edges are whole pages keyed by their first page, a child's lock count never exceeds
        its parent's, and the size counters match the tree."""
        total = evictable = 0
        for n in self._nodes():
            assert n.key and len(n.key) == len(n.pages) * self.page_size, "edge not page-aligned"
            assert n.parent.children.get(self._page_key(n.key, 0)) is n, "bad child key"
            assert n.lock_ref >= 0
            if n.parent is not self._root:
                assert n.lock_ref <= n.parent.lock_ref, "child locked more than its parent"
            total += len(n.pages)
            evictable += len(n.pages) if n.lock_ref == 0 else 0
        assert total == self._total, f"tree size {total} != counter {self._total}"
        assert evictable == self._evictable, f"evictable {evictable} != {self._evictable}"
