"""Session pins are bounded (issue 13): any client can name a session, so none can pin the
cache forever, take a large share of it, or keep an unbounded number of pins."""

from __future__ import annotations

import pytest

from braid.runtime.cache.memory_pool import PageAllocator
from braid.runtime.cache.radix_cache import RadixCache
from braid.runtime.scheduler.sessions import SessionPins


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cached(cache: RadixCache, alloc: PageAllocator, tokens: list[int]) -> list[int]:
    pages = alloc.alloc(len(tokens))
    cache.insert(tokens, pages)
    return tokens


@pytest.fixture
def pool():
    alloc = PageAllocator(129, 1)  # 128 pages of one token
    return alloc, RadixCache(alloc)


def test_pins_are_released_least_recently_used_first(pool):
    alloc, cache = pool
    pins = SessionPins(cache, max_pages=64, max_sessions=2, clock=Clock())
    for s in "abc":
        pins.pin(s, cached(cache, alloc, [ord(s)] * 4))
    assert len(pins) == 2 and pins.pinned_pages == 8
    assert not pins.close("a") and pins.close("b") and pins.close("c")
    assert cache.evictable_pages == 12  # every lock was released


def test_a_quiet_pin_expires(pool):
    alloc, cache = pool
    clock = Clock()
    pins = SessionPins(cache, max_pages=64, ttl_s=10.0, clock=clock)
    pins.pin("a", cached(cache, alloc, [1, 2, 3]))
    clock.now = 5.0
    pins.pin("b", cached(cache, alloc, [4, 5, 6]))
    clock.now = 12.0
    assert pins.expire() == 1 and len(pins) == 1  # "a" was quiet for 12 s, "b" for 7 s
    clock.now = 16.0
    assert pins.expire() == 1 and len(pins) == 0 and cache.evictable_pages == 6


def test_one_session_pins_at_most_half_and_all_at_most_max_pages(pool):
    alloc, cache = pool
    pins = SessionPins(cache, max_pages=64, clock=Clock())
    pins.pin("greedy", cached(cache, alloc, list(range(40))))
    assert len(pins) == 0  # 40 pages > 64 / 2: not pinned
    for i in range(5):  # 5 x 16 pages > 64: the oldest make room
        pins.pin(f"s{i}", cached(cache, alloc, [1000 + i] * 16))
        assert pins.pinned_pages <= 64
    assert len(pins) == 4 and pins.close("s4") and not pins.close("s0")
