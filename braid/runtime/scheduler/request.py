"""A request's state inside the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from braid.runtime.cache.radix_cache import TreeNode
from braid.runtime.constrained.grammar import GrammarMatcher
from braid.runtime.executor.sampler import SamplingInput
from braid.runtime.sampling_params import SamplingParams


@dataclass(eq=False)  # a request is itself: list membership tests compare identity
class Req:
    """One sample being generated.

    The first `kv_len` tokens of the sequence (prompt, then output) have KV, in `pages`, or
    will have once the forwards already queued on the device have run (a decode counts its
    token from launch; see `scheduler/overlap.py`), so anything queued later may read it. The
    first `shared_pages` of those pages belong to the prefix cache (locked through
    `cache_node`); the rest belong to this request. `cached_tokens` is how many prompt tokens
    the cache supplied at first admission.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    eos_ids: frozenset[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    pool_row: int | None = None
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    shared_pages: int = 0
    cache_node: TreeNode | None = None
    cached_tokens: int = 0
    admitted_once: bool = False
    retractions: int = 0
    error: str | None = None
    detok_sent: bool = False  # whether the detokenizer has been told how to decode it
    grammar: GrammarMatcher | None = None  # the output constraint, once compiled
    reported: int = 0  # output tokens already sent out in a TokenOut
    # Output tokens the model chose: the rest are jump-forward tokens of a greedy request that
    # the next extend's logits verify (see `Scheduler._verify_jump`), not reported until then.
    verified: int = 0
    prompt_logprobs_sent: bool = False
    finish_reason: str | None = None
    stop_token: int | None = None
    session_id: str | None = None  # the program session whose KV stays pinned after it

    def __post_init__(self) -> None:
        assert self.input_ids, "a request needs at least one prompt token"
        assert self.max_new_tokens >= 0  # 0: prefill only
        self._sampling = SamplingInput(
            params=self.params,
            seed=self.seed,
            prompt_ids=self.input_ids,
            output_ids=self.output_ids,
            stop_ids=sorted(self.eos_ids | set(self.params.stop_token_ids)),
        )

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def sampling(self) -> SamplingInput:
        return self._sampling

    def token_at(self, pos: int) -> int:
        n = len(self.input_ids)
        return self.input_ids[pos] if pos < n else self.output_ids[pos - n]

    def tokens(self, end: int | None = None) -> list[int]:
        """The sequence (prompt then output) up to `end`."""
        seq = self.input_ids + self.output_ids
        return seq if end is None else seq[:end]

    @property
    def unverified(self) -> int:
        return len(self.output_ids) - self.verified

    def take_unreported(self) -> list[int]:
        """Verified output tokens not yet sent out (the sampled one, plus any jump-forward
        tokens that need no verifying), marked as sent."""
        new = self.output_ids[self.reported : self.verified]
        self.reported = self.verified
        return new

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    def check_finished(self, token: int) -> None:
        """Set `finish_reason` if `token` (just appended) ends the request."""
        if token in self.params.stop_token_ids:
            self.finish_reason, self.stop_token = "stop", token
        elif token in self.eos_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
