"""Request bodies of the HTTP API (OpenAI-compatible and native), and how each becomes
`SamplingParams`. Validation errors become OpenAI-style 400s in `app.py`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from braid.runtime.sampling_params import SamplingParams


class _Body(BaseModel):
    # Unknown fields are ignored (as OpenAI and vLLM do); known fields are strictly typed.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Body):
    """Sampling fields shared by completions and chat, OpenAI's plus braid's extras."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # braid / vLLM / SGLang extras (the openai client sends them via extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output: OpenAI's response_format, or braid's extras
    response_format: ResponseFormat | None = None
    regex: str | None = None
    json_schema: dict[str, Any] | str | None = None
    choice: list[str] | None = None

    def constraint_fields(self) -> dict[str, Any]:
        fields = {k: getattr(self, k) for k in ("regex", "json_schema", "choice")}
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if any(v is not None for v in fields.values()):
                raise ValueError("response_format: do not combine with regex/json_schema/choice")
            if fmt.type == "json_object":
                fields["json_schema"] = {"type": "object"}
            else:
                if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                    raise ValueError("response_format: json_schema.schema is required")
                fields["json_schema"] = fmt.json_schema.schema_
        return {k: v for k, v in fields.items() if v is not None}

    def sampling_params(
        self, defaults: SamplingParams, *, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        """`SamplingParams` for this body; `ValueError` names a bad field."""
        fields: dict[str, Any] = dict(
            n=self.n,
            max_tokens=max_tokens if max_tokens is not None else defaults.max_tokens,
            min_tokens=self.min_tokens,
            temperature=self.temperature if self.temperature is not None else defaults.temperature,
            top_p=self.top_p if self.top_p is not None else defaults.top_p,
            top_k=self.top_k if self.top_k is not None else defaults.top_k,
            min_p=self.min_p if self.min_p is not None else defaults.min_p,
            repetition_penalty=self.repetition_penalty
            if self.repetition_penalty is not None
            else defaults.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            stop_regex=self.stop_regex,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            **self.constraint_fields(),
        )
        if self.logit_bias is not None:
            try:
                fields["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids") from None
        return SamplingParams(**fields)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    # Tool calling: shapes are checked by braid.runtime.function_call, whose errors name the
    # field precisely (tools[i].function.name, tool_choice.function.name, ...).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = True


class GenerateRequest(_Body):
    """SGLang's native /generate body."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Token texts are always in the logprob entries; accepted for SGLang clients.
    return_text_in_logprobs: bool = False
    # With return_logprob: also score the prompt from this position (SGLang's name; -1: no).
    logprob_start_len: int = -1
    rid: str | None = None
    # A program session: the finished sequence stays cached for it until /close_session.
    session_id: str | None = None


class AbortRequest(_Body):
    rid: str


class CloseSessionRequest(_Body):
    session_id: str


class TokenizeRequest(_Body):
    prompt: str


# SGLang's native sampling_params names -> braid's
NATIVE_SAMPLING_ALIASES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
NATIVE_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__) | set(NATIVE_SAMPLING_ALIASES)


def native_sampling_params(raw: dict[str, Any], defaults: SamplingParams) -> SamplingParams:
    unknown = set(raw) - NATIVE_SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"sampling_params: unknown field(s) {sorted(unknown)}")
    fields = {NATIVE_SAMPLING_ALIASES.get(k, k): v for k, v in raw.items()}
    if "logit_bias" in fields and isinstance(fields["logit_bias"], dict):
        try:
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        except ValueError:
            raise ValueError("sampling_params.logit_bias keys must be token ids") from None
    return defaults.replace(**fields)


FinishReason = Literal["stop", "length", "abort", "tool_calls"]
