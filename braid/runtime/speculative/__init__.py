"""Speculative decoding: a proposer guesses each running request's next tokens, the target model
scores every guess in one verify forward, and the longest run of guesses it agrees with is kept,
plus the token it chose after that run (see `base` for why the output is exactly what decoding
without speculation gives).

- `base`: the `Proposer` interface and what it reads of a request (`Drafting`).
- `ngram`: drafts looked up in the request's own prompt and output (no weights).
- `draft_model`: a smaller model with the same tokenizer, with its own paged KV.
- `medusa`: Medusa heads on the target's last hidden state.
- `eagle`: an EAGLE draft layer over the target's hidden states.

Proposers sit in `PROPOSERS`, a registry of lazily imported factories, by
`EngineConfig.speculative_algorithm`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from braid.runtime.registry import Registry

if TYPE_CHECKING:
    from braid.runtime.speculative.base import Proposer

PROPOSERS: Registry[type[Proposer]] = Registry(
    "speculative_algorithm",
    {
        "NGRAM": "braid.runtime.speculative.ngram",
        "DRAFT": "braid.runtime.speculative.draft_model",
        "MEDUSA": "braid.runtime.speculative.medusa",
        "EAGLE": "braid.runtime.speculative.eagle",
        "EAGLE3": "braid.runtime.speculative.eagle",
    },
)
