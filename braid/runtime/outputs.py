"""What `LLM.generate`, `LLM.chat` and `LLM.embed` return (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from braid.runtime.function_call.base import ToolCall
    from braid.runtime.ipc.to_detokenizer import SpecUsage


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token and the top alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample. `finish_reason` is "stop", "length" or "abort"; `stop_reason` is the stop
    string or stop token id that ended it (None for EOS or length). `tool_calls` is None
    unless `LLM.chat` was given tools; then it lists the calls parsed from `text`."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    tool_calls: list[ToolCall] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns for one prompt (vLLM's shape): `outputs.embedding` is the
    vector."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def finish_reason_info(
    reason: str | None, matched: Any = None, length: int = 0, message: str | None = None
) -> dict[str, Any] | None:
    """SGLang's `finish_reason` object for a runtime finish reason: stop (with what matched),
    length (how many tokens), abort (why)."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "abort":
        return {"type": "abort", "message": message}
    return {"type": reason, "matched": matched}


def spec_meta_info(spec: SpecUsage) -> dict[str, float]:
    """SGLang's `meta_info` fields for one request's speculative decoding: its decode steps
    (`spec_verify_ct`), the draft tokens it verified and kept, their ratio, and the mean tokens
    a decode step gave it (1 + the drafts kept per step)."""
    steps, proposed, accepted = spec.verify_steps, spec.proposed_drafts, spec.accepted_drafts
    return {
        "spec_verify_ct": steps,
        "spec_num_proposed_drafts": proposed,
        "spec_num_correct_drafts": accepted,
        "spec_accept_rate": accepted / proposed if proposed else 0.0,
        "spec_accept_length": (steps + accepted) / steps if steps else 0.0,
    }
