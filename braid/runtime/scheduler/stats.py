"""The scheduler's counters, shared by its parts (planners, KV owner, output)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Counters since the scheduler started."""

    finished_requests: int = 0
    embedding_requests: int = 0  # of those, embeddings (pooled prefills, nothing sampled)
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_prompt_tokens: int = 0  # of those, supplied by the prefix cache
    prefill_tokens_computed: int = 0  # tokens actually run through prefill (incl. resumes)
    decode_steps: int = 0  # steps that decoded running requests (mixed steps included)
    prefill_steps: int = 0
    chunked_prompts: int = 0  # prompts admitted with only a first chunk of their new tokens
    mixed_steps: int = 0  # prefill steps that carried decode rows (enable_mixed_chunk)
    mixed_decode_rows: int = 0  # decode rows those steps carried
    retractions: int = 0
    evicted_tokens: int = 0
    jump_forward_tokens: int = 0  # output tokens a grammar forced, appended without sampling
    jump_forward_rejected: int = 0  # of those, dropped because greedy decoding chose otherwise
    decode_steps_ahead: int = 0  # decode steps queued before the step before them was read
    constrained_steps_ahead: int = 0  # of those, steps with grammar rows
    # Time the scheduler's thread waited for the device to finish a step it reads back: near
    # zero a step means the host, not the device, sets the pace.
    readback_wait_seconds: float = 0.0
    # Speculative decoding: verify steps, request-steps in them (a request verifying drafts
    # in a step), draft tokens verified and kept, and tokens those request-steps appended.
    spec_verify_steps: int = 0
    spec_request_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def spec_accept_length(self) -> float:
        """Mean tokens a request gained per verify step it took part in (1 without drafts)."""
        n = self.spec_request_steps
        return self.spec_emitted_tokens / n if n else 0.0

    def as_dict(self) -> dict[str, float]:
        d = dict(self.__dict__)
        d["cache_hit_rate"] = self.cache_hit_rate
        d["spec_accept_length"] = self.spec_accept_length
        return d
