"""Messages the scheduler sends out after each step, towards detokenization."""

from __future__ import annotations

from dataclasses import dataclass, field

# Prompt tokens a request's detokenizer keeps as decoding context (`DetokSpec.prompt_tail`):
# enough for any tokenizer's merges at the boundary.
CONTEXT_TOKENS = 6


@dataclass
class TokenLogprob:
    """A token's raw-model log-probability, its rank, and the `top` alternatives
    as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class DetokSpec:
    """How to detokenize a request; sent with its first output."""

    prompt_tail: list[int]
    skip_special_tokens: bool
    stop: list[str]
    include_stop_str_in_output: bool
    min_tokens: int
    stop_regex: list[str] = field(default_factory=list)


@dataclass
class SpecUsage:
    """A request's speculative decoding, as SGLang's `meta_info` reports it: the decode steps
    it took (each verifying its drafts, if it had any), the draft tokens it verified and how
    many of them it kept."""

    verify_steps: int
    proposed_drafts: int
    accepted_drafts: int


@dataclass
class Refusal:
    """Why the error of a request's output is the request's own: it was refused before it ran
    (a grammar that does not compile, a value the scheduler cannot serve), so the front end
    answers it as a 400. `param` names the request field at fault, or is None."""

    param: str | None = None


@dataclass
class TokenOut:
    """What one request gained in one step.

    `finish_reason` is None while it runs, then "stop" (an EOS or stop token: `stop_token` says
    which stop token, None for EOS), "length", or "abort" (`error` says why if it failed).
    `prompt_logprobs` comes once, with the first token, when asked for (None for position 0).
    `embedding`: an embedding request's vector (little-endian float32 bytes), in its one
    output.
    """

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None = None
    stop_token: int | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    detok: DetokSpec | None = None
    refused: Refusal | None = None  # set when `error` is the request's own fault
    spec: SpecUsage | None = None  # with speculative decoding, in the request's last TokenOut
    embedding: bytes | None = None


@dataclass
class BatchTokenOut:
    outputs: list[TokenOut]
