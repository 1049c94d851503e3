"""The scheduler's counters, shared by its parts (planners, KV owner, output)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Counters since the scheduler started."""

    finished_requests: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_prompt_tokens: int = 0  # of those, supplied by the prefix cache
    prefill_tokens_computed: int = 0  # tokens actually run through prefill (incl. resumes)
    decode_steps: int = 0
    prefill_steps: int = 0
    retractions: int = 0
    evicted_tokens: int = 0
    jump_forward_tokens: int = 0  # output tokens a grammar forced, appended without sampling
    jump_forward_rejected: int = 0  # of those, dropped because greedy decoding chose otherwise
    constrained_steps_ahead: int = 0  # decode steps with grammar rows queued before the last read

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        d = dict(self.__dict__)
        d["cache_hit_rate"] = self.cache_hit_rate
        return d
