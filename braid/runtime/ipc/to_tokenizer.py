"""Messages the tokenizer manager (the caller's process) receives."""

from __future__ import annotations

from dataclasses import dataclass, field

from braid.runtime.ipc.to_detokenizer import Refusal, SpecUsage, TokenLogprob


@dataclass
class StrOut:
    """What one request gained: `text` is the new text safe to show (a tail that could start a
    stop string is held back until it cannot), `token_ids` the new tokens. When
    `finish_reason` is set this is the request's last message. `token_texts` decodes every
    token id that appears in `logprobs` / `prompt_logprobs`. `embedding`: an embedding
    request's vector (little-endian float32 bytes), with its one output."""

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    token_texts: dict[int, str] | None = None
    refused: Refusal | None = None  # set when the error is the request's own (see `Refusal`)
    spec: SpecUsage | None = None  # speculative decoding's counts, with the last output
    embedding: bytes | None = None


@dataclass
class BatchStrOut:
    outputs: list[StrOut]


@dataclass
class ProgramInfo:
    """One program as the scheduler sees it (`scheduler/programs.py`). `in_flight`: its
    requests waiting or running; `calls`: the calls it has sent (a gen's samples, a select's
    choices are one call), `calls_served`: those whose requests have all finished;
    `last_position`: the highest call position its requests carried (None: none carried one);
    `service`: the tokens computed for it (its attained service); `pinned_tokens`,
    `pinned_sessions`: the KV its sessions keep pinned between calls."""

    id: str
    in_flight: int
    calls: int
    calls_served: int
    last_position: int | None
    service: int
    pinned_tokens: int
    pinned_sessions: int


@dataclass
class ControlOut:
    """The answer to a `ControlReq`: `result` its figures; for "stats", `programs` the
    programs in flight or holding pins (`Scheduler.program_infos`); for "stop_profile",
    `detail` the files written."""

    req_id: int
    ok: bool
    result: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    programs: list[ProgramInfo] | None = None
    detail: list[str] | None = None


@dataclass
class SchedulerReady:
    """Sent once the model is loaded: what the front end needs to validate requests."""

    context_length: int
    kv_capacity_tokens: int
    max_running_requests: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    load_time_s: float
    # The scheduler's start-up phases in seconds, by name, in order (weights, KV sizing,
    # graph capture, ...): shown in `braid serve`'s ready line. Empty: only `load_time_s`.
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class ProcessFailed:
    """A child process hit an error it cannot recover from; the runtime shuts down."""

    process: str
    error: str


@dataclass
class SchedulerHeartbeat:
    """Sent by a thread of the scheduler process twice a second: its latest stats, and how long
    ago its loop last completed an iteration. The front end answers `/metrics` and
    `/get_server_info` from it and `/health` by its age, so none of them waits on a scheduler
    that is stuck (or stopped). `programs`: as `ControlOut.programs`, as of `stats`."""

    stats: dict[str, float]
    loop_age_s: float
    programs: list[ProgramInfo] = field(default_factory=list)


def merge_str_outs(a: StrOut, b: StrOut) -> StrOut:
    """One output saying what `a` then `b` (two consecutive outputs of one sample) say: texts,
    token ids and logprobs concatenated, counts and finish from `b`. `a` is changed in place
    and returned."""
    a.text += b.text
    a.token_ids += b.token_ids
    a.prompt_tokens, a.completion_tokens = b.prompt_tokens, b.completion_tokens
    a.cached_tokens = b.cached_tokens
    a.finish_reason, a.stop_reason, a.error = b.finish_reason, b.stop_reason, b.error
    a.refused = b.refused
    a.spec = b.spec if b.spec is not None else a.spec
    a.embedding = b.embedding if b.embedding is not None else a.embedding
    if b.logprobs:
        a.logprobs = (a.logprobs or []) + b.logprobs
    if b.prompt_logprobs is not None:
        a.prompt_logprobs = b.prompt_logprobs
    if b.token_texts:
        a.token_texts = {**(a.token_texts or {}), **b.token_texts}
    return a
