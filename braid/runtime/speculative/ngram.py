"""N-gram (prompt lookup) drafts: the tokens that followed the last earlier occurrence of the
text's own suffix.

For each request the last `max_match` tokens of its prompt-plus-output are looked up in the
text before them, then shorter suffixes down to `min_match`; the longest suffix found wins, at
its most recent occurrence, and the tokens after that occurrence are the drafts (repeated as a
loop where they reach the end of the text: the text is taken to repeat from the match). No
weights: it pays off where output repeats its input (editing code, quoting a source, JSON that
echoes a prompt) or itself (a model caught in a loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from braid.runtime.speculative import PROPOSERS
from braid.runtime.speculative.base import Drafting, Proposer

if TYPE_CHECKING:
    from braid.runtime.config import EngineConfig
    from braid.runtime.executor.model_runner import ModelRunner


def lookup(tokens: np.ndarray, min_match: int, max_match: int, k: int) -> list[int]:
    """`k` tokens guessed from the most recent earlier occurrence of the longest suffix of
    `tokens` (between `min_match` and `max_match` long) that occurs earlier: those after it,
    repeated from there when they run out; [] if there is none."""
    n = tokens.shape[0]
    if k < 1 or n < min_match + 1:
        return []
    for size in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = tokens[n - size :]
        # Windows starting at 0 .. n - size - 1: every occurrence that ends before the suffix's
        # own last token (the suffix itself is not a match).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: n - 1], size)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + size
            run = tokens[start:].tolist()
            # If the text repeats from the match, it goes on repeating past its end: a loop's
            # most recent match sits right before the end, with only a few tokens after it.
            return [run[j % len(run)] for j in range(k)]
    return []


@PROPOSERS.register
class NgramProposer(Proposer):
    name = "NGRAM"

    def __init__(self, *, min_match: int, max_match: int) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"n-gram match sizes must satisfy 1 <= {min_match} <= {max_match}")
        self.min_match = min_match
        self.max_match = max_match

    @classmethod
    def from_config(cls, config: EngineConfig, target: ModelRunner) -> NgramProposer:
        return cls(
            min_match=config.speculative_ngram_min_match_window_size,
            max_match=config.speculative_ngram_max_match_window_size,
        )

    def propose(self, reqs: Sequence[Drafting], limits: Sequence[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, limits):
            if k < 1:
                out.append([])
                continue
            # Only the last stretch can matter for a long text: bound the work per step.
            tokens = np.asarray(req.tokens()[-LOOKBACK:], dtype=np.int64)
            out.append(lookup(tokens, self.min_match, self.max_match, k))
        return out


# The most recent tokens searched for a match (a match further back is rarely the best guess,
# and the lookup costs time linear in this).
LOOKBACK = 8192
