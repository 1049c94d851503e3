"""Response bodies of the OpenAI-compatible routes as pydantic models, as the request bodies
are in `protocol.py`: completions and chat completions (whole, and their stream chunks), their
usage, embeddings, and the error body every route answers with.

Whole responses are built through these models and encoded by `outputs.encode_listed`. A
stream's chunks are not built per token: `outputs.ChunkEncoder` writes each chunk as the chunk
model's head (encoded once per response, from the model) followed by the choice as plain data,
which keeps a token's chunk at one small encode; tests hold that every chunk parses into the
chunk model (`extra="forbid"`: a key the model lacks is a failure).

A field whose default is `MISSING` is left out of the body unless it is set (to a value or to
None), as OpenAI's bodies leave out what does not apply: a choice's `stop_reason` and `error`,
a message's reasoning (present, maybe null, with a reasoning parser) and tool calls, usage's
speculative-decoding details, a chunk's usage (null on every chunk with `include_usage`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import MISSING, BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# How a choice ended: a stop string, token or EOS; max_tokens or the context; aborted or
# failed (a choice `error` says why); tool calls (chat with tools).
FinishReason = Literal["stop", "length", "abort", "tool_calls"]


# ---- errors -----------------------------------------------------------------------------------
class ErrorInfo(_Body):
    message: str
    type: str
    param: str | None  # the request field at fault, as data (never parsed from the message)
    code: int


class ErrorResponse(_Body):
    """Every error, from every route (unknown ones too): OpenAI's shape."""

    error: ErrorInfo


class ChoiceError(_Body):
    """Why a choice that had started failed (its finish reason is "abort")."""

    message: str
    type: str


# ---- usage ------------------------------------------------------------------------------------
class PromptTokensDetails(_Body):
    cached_tokens: int


class CompletionTokensDetails(_Body):
    """Speculative decoding's draft tokens, in OpenAI's fields for predicted tokens."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | MISSING = MISSING


# ---- completions ------------------------------------------------------------------------------
class CompletionLogprobs(_Body):
    """Per token (prompt tokens first with `echo`; None where a position has no score)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None
    stop_reason: str | int | MISSING = MISSING
    error: ChoiceError | MISSING = MISSING


class Completion(_Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(_Body):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None
    stop_reason: str | int | MISSING = MISSING  # on the choice's last chunk, as vLLM's
    error: ChoiceError | MISSING = MISSING


class CompletionChunk(_Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None | MISSING = MISSING


# ---- chat completions -------------------------------------------------------------------------
class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob]


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Body):
    """A chat choice's message. With a reasoning parser, its thinking is under both names
    clients read (`reasoning_content`: SGLang, DeepSeek; `reasoning`: vLLM's newer name)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None | MISSING = MISSING
    reasoning: str | None | MISSING = MISSING
    tool_calls: list[ToolCall] | MISSING = MISSING


class ChatChoice(_Body):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None
    stop_reason: str | int | MISSING = MISSING
    error: ChoiceError | MISSING = MISSING


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Body):
    name: str | MISSING = MISSING
    arguments: str


class ToolCallDelta(_Body):
    """A piece of call number `index`: its first piece carries the id, type and name."""

    index: int
    id: str | MISSING = MISSING
    type: Literal["function"] | MISSING = MISSING
    function: FunctionCallDelta


class ChatDelta(_Body):
    role: Literal["assistant"] | MISSING = MISSING
    content: str | MISSING = MISSING
    reasoning_content: str | MISSING = MISSING
    reasoning: str | MISSING = MISSING
    tool_calls: list[ToolCallDelta] | MISSING = MISSING


class ChatChunkChoice(_Body):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None
    stop_reason: str | int | MISSING = MISSING  # on the choice's last chunk, as vLLM's
    error: ChoiceError | MISSING = MISSING


class ChatCompletionChunk(_Body):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | MISSING = MISSING


# ---- embeddings -------------------------------------------------------------------------------
class Embedding(_Body):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 bytes


class EmbeddingUsage(_Body):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Body):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
