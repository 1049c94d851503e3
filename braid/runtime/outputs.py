"""A sample's outputs as they arrive (`SampleOutputs`, which every front end gathers them
with: the server, `LLM` and the language's engine backend), and what `LLM.generate`,
`LLM.chat` and `LLM.embed` return (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from braid.runtime.function_call.base import ToolCall
    from braid.runtime.ipc.to_detokenizer import Refusal, SpecUsage, TokenLogprob
    from braid.runtime.ipc.to_tokenizer import StrOut


@dataclass
class SampleOutputs:
    """One sample's outputs so far, gathered from its `StrOut`s in order by `add`: its text
    and token ids, its tokens' logprobs and the prompt's (the runtime's `TokenLogprob`s, which
    each front end presents in its own shape), the texts of the token ids they name, the
    latest prompt, cached and completion token counts, and once it has finished, why (finish
    reason, stop reason, error, `refused`) and its speculative-decoding counts."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    token_texts: dict[int, str] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    refused: Refusal | None = None
    spec: SpecUsage | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, out: StrOut) -> None:
        """Add `out`, the sample's next output: its text and tokens follow what came before,
        its counts replace the earlier ones, and a finish ends the sample."""
        self.text += out.text
        self.token_ids += out.token_ids
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.completion_tokens = out.completion_tokens
        if out.logprobs:
            self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.token_texts:
            self.token_texts.update(out.token_texts)
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            self.error, self.refused, self.spec = out.error, out.refused, out.spec


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token and the top alternatives).
PositionLogprobs = dict[int, Logprob]


def logprob_dict(lp: TokenLogprob, texts: dict[int, str] | None) -> dict[int, Logprob]:
    """vLLM's per-position dict: the chosen token and the top alternatives."""
    texts = texts or {}
    d = {lp.token_id: Logprob(lp.logprob, lp.rank, texts.get(lp.token_id))}
    for rank, (tid, val) in enumerate(lp.top, start=1):
        if tid not in d:
            d[tid] = Logprob(val, rank, texts.get(tid))
    return d


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
