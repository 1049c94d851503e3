"""What every proposer implements, and why verifying drafts this way is exact.

A verify forward is a decode batch with several rows per request. For a request whose last
sampled token sits at position p (it has no KV yet) and whose drafts are d_1..d_k, row j
computes the KV of position p + j (the last token for j = 0, d_j after it) and attends to
every position up to its own: the chain's causal mask is the rows' lengths, so the decode
attention kernels, and the decode CUDA graphs, run it unchanged. Each row is sampled exactly as
the decode step of its position would be: the request's own seed and step (braid's draws are
counter-based: a pure function of seed, step and the logits), its penalties and `min_tokens`
over the output with the drafts before the row, and its grammar's mask advanced over them.

A draft is kept while it equals the target's own sample at its row; the first row whose sample
differs (or the row after the last draft) gives one more token. So the kept tokens are,
token for token, those decoding without speculation would give, greedy or sampled: a greedy
row keeps a draft when it is the argmax; a sampled row when the target's draw there picks it.
For a draft token d this accepts with probability p(d), which is what rejection sampling with a
deterministic draft accepts with; the draws are coupled instead of independent, so the output
does not depend on whether speculation ran (and the distribution cannot move).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from braid.runtime.speculative.tree import DraftTree

if TYPE_CHECKING:
    from braid.runtime.config import EngineConfig
    from braid.runtime.executor.model_runner import ModelRunner
    from braid.runtime.executor.sampler import SamplingInput
    from braid.runtime.models.config import ModelConfig


class Drafting(Protocol):
    """What a proposer reads of a request (the scheduler's `Req`)."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    params: Any  # SamplingParams
    seed: int

    @property
    def seq_len(self) -> int: ...

    @property
    def sampling(self) -> SamplingInput:
        """How its next token is sampled (its output so far, live)."""

    def tokens(self, end: int | None = None) -> list[int]: ...


class Proposer(ABC):
    """Guesses the next tokens of running requests.

    Each decode step the scheduler calls `propose` with the requests about to decode (each
    request's last token is sampled and not yet in the target's KV) and, per request, the most
    drafts it may take; after the verify forward it calls `verified` with how many were kept.
    `release` is called whenever a request gives its KV back (finished, aborted, retracted or
    failed), so a proposer holding per-request state (a draft model's KV) drops it. Proposers
    run in the scheduler's thread only."""

    name: ClassVar[str]
    # Most nodes of a draft tree it proposes (0: it proposes chains only), and of the scratch
    # KV slots it takes while drafting one (pages the drafter makes room for).
    tree_nodes: int = 0
    scratch_nodes: int = 0

    @classmethod
    @abstractmethod
    def from_config(cls, config: EngineConfig, target: ModelRunner) -> Proposer:
        """The proposer `config` asks for, beside the target model's runner; `ValueError`
        naming the setting when it cannot be built (a draft model that does not fit the
        target, a checkpoint of the wrong shape)."""

    @classmethod
    def target_capture(
        cls, config: EngineConfig, model: ModelConfig
    ) -> tuple[bool, tuple[int, ...]]:
        """What the proposer reads of the target's forwards: whether its final hidden states
        (`ForwardBatch.capture_hidden`) and the inputs of which layers (`aux_layers`). Asked
        before the target model is built (its CUDA graphs capture them too)."""
        return False, ()

    def observe(
        self,
        reqs: Sequence[Drafting],
        starts: Sequence[int],
        rows: Sequence[Sequence[int]],
        batch: Any,
    ) -> None:
        """After a target forward that `target_capture` asked hidden states of: `rows[i]` are
        the rows of `batch.hidden_states` (and `batch.aux_hidden_states`) holding the positions
        `starts[i]`, `starts[i] + 1`, ... of `reqs[i]` that this forward computed and kept (the
        row of position t predicts the token at t + 1). Valid until the next forward."""
        return None

    @abstractmethod
    def propose(
        self, reqs: Sequence[Drafting], limits: Sequence[int]
    ) -> list[list[int] | DraftTree]:
        """Draft tokens for each request, at most `limits[i]` deep for `reqs[i]` (0: none):
        a chain (the tokens in the order they would follow its last token) or a `DraftTree`
        (of at most `tree_nodes` nodes)."""

    def verified(self, req: Drafting, drafts: DraftTree, kept: int) -> None:
        """The verify step kept `kept` nodes of `drafts` (the first `kept` of a chain), and
        appended one more token of the target's own unless `req` finished first."""
        return None

    def release(self, req: Drafting) -> None:
        """`req` gave back its KV; drop whatever is held for it."""
        return None

    def shutdown(self) -> None:
        """Free what the proposer holds (a draft model's memory)."""
        return None
