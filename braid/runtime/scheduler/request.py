"""A request's state inside the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from braid.runtime.executor.sampler import SamplingInput
from braid.runtime.sampling_params import SamplingParams


@dataclass
class Req:
    """One sample being generated.

    `kv_len` tokens of `all_ids` have KV in the pool, in `pages`; `reserved_pages` is how many
    pages it may grow to (taken from the pool's budget at admission, so decode never runs out).
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
    reserved_pages: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_token: int | None = None

    def __post_init__(self) -> None:
        assert self.input_ids, "a request needs at least one prompt token"
        assert self.max_new_tokens >= 1
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

    def check_finished(self, token: int) -> None:
        """Set `finish_reason` if `token` (just appended) ends the request."""
        if token in self.params.stop_token_ids:
            self.finish_reason, self.stop_token = "stop", token
        elif token in self.eos_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
