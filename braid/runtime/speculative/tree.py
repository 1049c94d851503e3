"""Draft trees: several guesses verified at once. Node i follows node `parents[i]` (-1: the
request's last token), so a branch is a guessed continuation and siblings are alternatives for
the same position; a chain (each node following the one before) is the common case.

The verify step gives every node its own row (see `braid.runtime.scheduler.verify`) and keeps the
deepest branch the target agrees with node by node: from the last token, the child whose token
is the target's sample at the parent's row, again and again.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens with their parents (`parents[i]` < i, or -1 for the last token)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents)
        assert all(-1 <= p < i for i, p in enumerate(self.parents)), "parents come first"

    @classmethod
    def chain(cls, tokens: Iterable[int]) -> DraftTree:
        tokens = tuple(tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth (1: a child of the last token)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return tuple(out)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    @cached_property
    def children(self) -> dict[int, dict[int, int]]:
        """parent -> {token: child} (the first child wins where siblings repeat a token)."""
        out: dict[int, dict[int, int]] = {}
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            out.setdefault(p, {}).setdefault(t, i)
        return out

    def clip(self, max_depth: int, max_nodes: int, vocab_size: int) -> DraftTree:
        """Without the nodes deeper than `max_depth`, with a token outside the vocabulary, or
        past the first `max_nodes`, and without their descendants."""
        keep: dict[int, int] = {-1: -1}
        tokens, parents = [], []
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if (
                len(tokens) < max_nodes
                and p in keep
                and self.depths[i] <= max_depth
                and 0 <= t < vocab_size
            ):
                keep[i] = len(tokens)
                tokens.append(t)
                parents.append(keep[p])
        return DraftTree(tuple(tokens), tuple(parents))


def best_first(candidates: Sequence[Sequence[tuple[int, float]]], max_nodes: int) -> DraftTree:
    """The tree of the `max_nodes` likeliest continuations when position d (from 0) has the
    guesses `candidates[d]` (token, probability), independently of the tokens before it (Medusa
    heads): a node's score is the product of its path's probabilities, and nodes are taken
    best first, so every node's parent is in the tree."""
    tokens: list[int] = []
    parents: list[int] = []
    heap = [(-p, 0, k, -1) for k, (_, p) in enumerate(candidates[0])] if candidates else []
    heapq.heapify(heap)
    while heap and len(tokens) < max_nodes:
        neg, depth, k, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(candidates[depth][k][0])
        parents.append(parent)
        if depth + 1 < len(candidates):
            for k2, (_, p) in enumerate(candidates[depth + 1]):
                heapq.heappush(heap, (neg * p, depth + 1, k2, node))
    return DraftTree(tuple(tokens), tuple(parents))
