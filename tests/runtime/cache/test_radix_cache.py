"""The radix tree against a plain reference model, under random operation sequences.

The reference is a dict from each cached page-aligned prefix (a tuple of tokens) to the page
holding its last page of tokens: `match_prefix` must return the longest chain of prefixes in it,
`insert` must add exactly the missing ones, eviction must keep it prefix-closed and never touch
a locked path. Page conservation is checked against the allocator after every operation.
"""

from __future__ import annotations

import heapq
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from braid.runtime.cache.memory_pool import PageAllocator
from braid.runtime.cache.radix_cache import RadixCache

ALPHABET = 3  # few distinct tokens: sequences share prefixes often


class Harness:
    def __init__(self, page_size: int, pages: int = 400) -> None:
        self.ps = page_size
        self.alloc = PageAllocator(pages + 1, page_size)
        self.cache = RadixCache(self.alloc)
        self.ref: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[object, list[tuple[int, ...]]]] = []  # (node, prefixes on path)

    def prefixes(self, tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[: (i + 1) * self.ps]) for i in range(len(tokens) // self.ps)]

    def ref_match(self, tokens: list[int]) -> list[int]:
        out = []
        for p in self.prefixes(tokens):
            if p not in self.ref:
                break
            out.append(self.ref[p])
        return out

    def check(self) -> None:
        self.cache.check_invariants()
        cached = self.cache.cached_pages()
        assert sorted(cached) == sorted(self.ref.values())
        assert self.alloc.free_pages + len(cached) == self.alloc.capacity_pages
        # Prefix-closed: every cached prefix's parent prefix is cached too.
        for p in self.ref:
            if len(p) > self.ps:
                assert p[: -self.ps] in self.ref

    def match(self, tokens: list[int]) -> None:
        got = self.cache.match_prefix(tokens)
        assert got.pages == self.ref_match(tokens)

    def insert(self, tokens: list[int]) -> None:
        n = len(tokens) // self.ps
        tokens = tokens[: n * self.ps]
        pages = self.alloc.alloc(n)
        if pages is None:
            return
        dups = self.cache.insert(tokens, pages)
        expected_dups = [pg for p, pg in zip(self.prefixes(tokens), pages) if p in self.ref]
        assert dups == expected_dups
        for p, pg in zip(self.prefixes(tokens), pages):
            self.ref.setdefault(p, pg)
        self.alloc.free(dups)

    def lock(self, tokens: list[int]) -> None:
        m = self.cache.match_prefix(tokens)
        self.cache.lock(m.node)
        self.locks.append((m.node, self.prefixes(tokens)[: len(m.pages)]))

    def unlock(self, i: int) -> None:
        if self.locks:
            node, _ = self.locks.pop(i % len(self.locks))
            self.cache.unlock(node)

    def evict(self, n: int) -> None:
        locked = {p for _, ps in self.locks for p in ps}
        before = dict(self.ref)
        want = lru_victims(self.cache, n)
        freed = self.cache.evict(n)
        remaining = set(self.cache.cached_pages())
        assert set(before.values()) - remaining == want, "not the least recently used leaves"
        self.ref = {p: pg for p, pg in self.ref.items() if pg in remaining}
        assert len(before) - len(self.ref) == freed
        assert locked <= set(self.ref), "a locked prefix was evicted"
        # Whole leaves go, so more than asked may be freed; less only when nothing is left.
        assert freed >= n or self.cache.evictable_pages == 0


def lru_victims(cache: RadixCache, n: int) -> set[int]:
    """The pages evicting `n` pages frees, found by brute force: every unlocked leaf of the
    whole tree in a heap by last use, a parent joining it once its last child is gone."""
    children = {id(node): len(node.children) for node in [cache.root, *cache._nodes()]}
    heap = [(x.last_access, i, x) for i, x in enumerate(cache._leaves()) if x.lock_ref == 0]
    heapq.heapify(heap)
    pages: set[int] = set()
    while len(pages) < n and heap:
        _, _, leaf = heapq.heappop(heap)
        pages.update(leaf.pages)
        parent = leaf.parent
        children[id(parent)] -= 1
        if parent is not cache.root and children[id(parent)] == 0 and parent.lock_ref == 0:
            heapq.heappush(heap, (parent.last_access, -len(pages), parent))
    return pages


tokens_st = st.lists(st.integers(0, ALPHABET - 1), min_size=0, max_size=24)
op_st = st.one_of(
    st.tuples(st.just("insert"), tokens_st),
    st.tuples(st.just("match"), tokens_st),
    st.tuples(st.just("lock"), tokens_st),
    st.tuples(st.just("unlock"), st.integers(0, 50)),
    st.tuples(st.just("evict"), st.integers(0, 12)),
)


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, max_size=40))
def test_random_operations_match_the_reference(page_size, ops):
    h = Harness(page_size)
    for op, arg in ops:
        getattr(h, op)(arg)
        h.check()
    while h.locks:
        h.unlock(0)
    h.check()
    h.cache.reset()
    assert h.alloc.free_pages == h.alloc.capacity_pages
    assert h.cache.heap_rebuilds == 0  # every leaf that could go was offered when it could


def test_eviction_does_not_walk_the_tree():
    """A cache of many requests evicts what it must without a walk over every node: each
    call pops its victims (a walk would visit all 3000 leaves per call)."""
    rng = random.Random(0)
    alloc = PageAllocator(3000 * 16 + 1, 1)
    cache = RadixCache(alloc)
    for _ in range(3000):
        cache.insert([rng.randrange(1000) for _ in range(16)], alloc.alloc(16))
    visited = 0
    leaves = cache._leaves

    def counting():
        nonlocal visited
        got = leaves()
        visited += len(got)
        return got

    cache._leaves = counting
    for _ in range(200):
        assert cache.evict(4) >= 4
    assert visited == 0 and cache.heap_rebuilds == 0
    cache.check_invariants()


def test_lru_evicts_the_least_recently_used_leaf_first():
    h = Harness(page_size=1)
    h.insert([0, 0, 0])
    h.insert([1, 1, 1])
    h.insert([2, 2, 2])
    h.match([0, 0, 0])  # touch the oldest: [1, 1, 1] becomes least recent
    h.evict(3)
    assert set(h.ref) == {(0,), (0, 0), (0, 0, 0), (2,), (2, 2), (2, 2, 2)}
    h.check()


def test_match_splits_a_node_and_says_so():
    h = Harness(page_size=2)
    h.insert([1, 2, 3, 4, 5, 6])
    (node,) = h.cache.root.children.values()
    assert len(node.pages) == 3
    m = h.cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert len(m.pages) == 2 and m.node is not node and m.node.children
    assert len(m.node.children) == 1 and list(m.node.children.values())[0] is node
    h.check()


def test_partial_page_never_matches():
    h = Harness(page_size=4)
    h.insert([1, 2, 3, 4, 5, 6, 7, 8])
    assert h.cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).pages == h.ref_match([1, 2, 3, 4])
    assert len(h.cache.match_prefix([1, 2, 3]).pages) == 0


def test_a_leaf_skipped_while_locked_is_evicted_in_turn_once_unlocked():
    h = Harness(page_size=1)
    h.insert([0, 0])
    h.insert([1, 1])
    h.lock([0, 0])
    h.evict(1)  # [0, 0] is older but locked: [1, 1] goes
    assert set(h.ref) == {(0,), (0, 0)}
    h.unlock(0)
    h.insert([2, 2])
    h.evict(1)  # [0, 0] is now the least recently used unlocked leaf
    assert set(h.ref) == {(2,), (2, 2)}
    assert h.cache.heap_rebuilds == 0
    h.check()
