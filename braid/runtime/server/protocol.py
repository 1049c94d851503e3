"""Request bodies of the HTTP API (OpenAI-compatible and native), and how each becomes
`SamplingParams`. Validation errors become OpenAI-style 400s in `app.py`.

Types are strict, as OpenAI's are (`"0.5"` is not a temperature, `"yes"` is not a bool).
Integers must fit in 64 bits and strings must be valid Unicode (no lone surrogates such as
`"\\ud800"`, which JSON can spell but UTF-8 cannot): both are refused here, naming the field,
rather than failing later on their way to the scheduler. Unions list the list-of-ints member
first, so a long token-id prompt validates in one pass.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from braid.runtime.errors import ParamError
from braid.runtime.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, SamplingParams

_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_surrogates(s: str) -> str:
    if s.isascii():  # the common case, in microseconds even for megabytes
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        pass
    m = _SURROGATE.search(s)
    if m:
        raise ValueError(
            f"contains a lone surrogate ({m.group()!a} at character {m.start()}), "
            "which is not valid Unicode"
        )
    return s


def check_json_value(v: Any, where: str = "") -> Any:
    """`v` unchanged if every string in it is valid Unicode and every integer fits in 64 bits;
    else `ValueError` naming the path (for free-form fields: schemas, tools, sampling_params)."""
    stack = [(v, where)]
    while stack:
        x, at = stack.pop()
        if isinstance(x, str):
            try:
                _no_surrogates(x)
            except ValueError as e:
                raise ValueError(f"{at}: {e}" if at else str(e)) from None
        elif isinstance(x, bool) or x is None or isinstance(x, float):
            continue
        elif isinstance(x, int):
            if not INT64_MIN <= x <= INT64_MAX:
                raise ValueError(
                    f"{at or 'value'}: {x} is out of range (integers must fit in 64 bits)"
                )
        elif isinstance(x, dict):
            for k, item in x.items():
                stack.append((k, at))
                stack.append((item, f"{at}.{k}" if at else str(k)))
        elif isinstance(x, (list, tuple)):
            stack.extend((item, f"{at}[{i}]") for i, item in enumerate(x))
    return v


Text = Annotated[str, AfterValidator(_no_surrogates)]
Int = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
# A request id, a cache salt: a short non-empty string.
Name = Annotated[Text, Field(min_length=1, max_length=256)]


def _doc(**bounds: Any) -> Any:
    """Bounds stated in the OpenAPI schema only: `SamplingParams` checks them, with messages
    that name the field (and say why)."""
    return Field(json_schema_extra=bounds)


JsonObject = Annotated[dict[str, Any], AfterValidator(check_json_value)]
JsonValue = Annotated[Any, AfterValidator(check_json_value)]


def _null_means_default(schema: dict[str, Any], model: Any) -> None:
    """The OpenAPI schema says what `_Body` reads: a field with a default takes null too."""
    for name, info in model.model_fields.items():
        key = info.alias or name
        prop = schema.get("properties", {}).get(key)
        if prop is None or info.is_required() or info.default is None:
            continue
        kept = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
        schema["properties"][key] = {"anyOf": [prop, {"type": "null"}], **kept}


class _Body(BaseModel):
    """A request body. Closed: an unknown field is a 400 naming it, as OpenAI's API answers
    ("Unrecognized request argument supplied"), never dropped; fields are strictly typed.
    `INERT` lists fields braid takes only at values that change nothing (name -> why another
    value is refused, the inert values): other servers' fields that clients or routers send
    with their defaults; `refuse_inert` refuses the rest by name."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_null_means_default)
    INERT: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        """A null for a field with a default is the default, as OpenAI and vLLM read it (the
        openai client sends `n=None` as null); a null for a field braid does not know asks for
        nothing (SGLang's benchmark sends `lora_path: null`) and is dropped too."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None
            or (k in fields and (fields[k].is_required() or fields[k].default is None))
        }

    def refuse_inert(self) -> None:
        """A `ParamError` naming the first `INERT` field given a value that does something."""
        for name, (why, inert) in self.INERT.items():
            value = getattr(self, name)
            if not any(value == v and type(value) is type(v) for v in inert):
                raise ParamError.at(name, f"not supported ({why})")


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False
    # OpenAI's padding of stream events against length side channels: braid adds none.
    include_obfuscation: bool = False


class JsonSchemaFormat(_Body):
    name: Text | None = None
    # OpenAI's: what the format is for (the schema constrains the output; the model never
    # sees the description).
    description: Text | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # type "structural_tag" (SGLang's and vLLM's shape): [{"begin", "schema", "end"}], triggers
    structures: list[JsonObject] | None = None
    triggers: list[Text] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (one constraint, and options braid already applies). Closed:
    an option braid does not know is refused, never ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: JsonObject | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: JsonObject | Text | None = None
    # braid's JSON is compact and its objects are closed already; fallback is braid's own.
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def constraints(self) -> list[tuple[str, str, Any]]:
        """(where, kind, spec) of each constraint given."""
        out = []
        if self.json_ is not None:
            out.append(("structured_outputs.json", "json_schema", self.json_))
        if self.json_object:
            out.append(("structured_outputs.json_object", "json_schema", {"type": "object"}))
        for name in ("regex", "choice", "structural_tag"):
            if getattr(self, name) is not None:
                out.append((f"structured_outputs.{name}", name, getattr(self, name)))
        if self.grammar is not None:
            out.append(("structured_outputs.grammar", grammar_kind(self.grammar), self.grammar))
        return out


def grammar_kind(grammar: str) -> str:
    """vLLM's `grammar` fields take EBNF or Lark: which this one is."""
    from braid.runtime.constrained.spec import is_lark

    return "lark" if is_lark(grammar) else "ebnf"


# Constraint fields of other servers that braid does not implement: refused by name, since the
# lenient bodies would otherwise drop them and answer with free text.
REFUSED_CONSTRAINT_FIELDS = {
    "guided_whitespace_pattern": "braid writes compact JSON; a whitespace pattern is not taken",
    "guided_decoding_backend": "the grammar backend is the server's (--grammar-backend)",
    "guided_json_object": "use response_format {'type': 'json_object'}",
}


# Other servers' fields that change the output and that braid does not implement, or that
# SGLang's router sends with their defaults: taken only at values that change nothing.
REFUSED_FIELDS = {
    "use_beam_search": ("beam search is not implemented", (None, False)),
    "length_penalty": ("it applies to beam search, which is not implemented", (None, 1, 1.0)),
    "logits_processors": ("braid runs no request code", (None, [])),
    "prompt_logprobs": ("use echo with logprobs (completions)", (None,)),
    "return_tokens_as_token_ids": ("tokens are returned as text", (None, False)),
    "return_hidden_states": ("braid returns no hidden states", (None, False)),
}


# OpenAI's fields, on chat and on Responses, that ask for what braid does not do.
OPENAI_INERT = {
    "prompt_cache_retention": (
        "the prefix cache keeps what its memory holds, for no set time",
        (None, "in_memory"),
    ),
    "prompt_cache_options": ("the prefix cache takes no breakpoints or lifetimes", (None,)),
    "moderation": ("braid runs no moderation", (None,)),
}


# What the two completion APIs refuse once beam search (use_beam_search, length_penalty) is
# served.
BEAM_SEARCH_SERVED = {
    k: v for k, v in REFUSED_FIELDS.items() if k not in ("use_beam_search", "length_penalty")
}


class _SamplingFields(_Body):
    """Sampling fields shared by completions and chat, OpenAI's plus braid's extras."""

    model: Text | None = None
    n: Annotated[Int, _doc(minimum=1)] = 1
    max_tokens: Annotated[Int, _doc(minimum=0)] | None = None
    temperature: Annotated[float, _doc(minimum=0)] | None = None
    top_p: Annotated[float, _doc(exclusiveMinimum=0, maximum=1)] | None = None
    stop: Text | list[Text] | None = None
    seed: Int | None = None
    frequency_penalty: Annotated[float, _doc(minimum=-2, maximum=2)] = 0.0
    presence_penalty: Annotated[float, _doc(minimum=-2, maximum=2)] = 0.0
    logit_bias: dict[Text, float] | None = None
    user: Text | None = None
    # vLLM's: only requests with the same salt share this prompt's cached KV.
    cache_salt: Name | None = None
    # vLLM's: under --schedule-policy priority, lower values are admitted first.
    priority: Int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # braid / vLLM / SGLang extras (the openai client sends them via extra_body)
    top_k: Int | None = None
    min_p: Annotated[float, _doc(minimum=0, maximum=1)] | None = None
    repetition_penalty: float | None = None
    min_tokens: Annotated[Int, _doc(minimum=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    stop_regex: Text | list[Text] | None = None
    allowed_token_ids: list[Int] | None = None
    bad_words: list[Text] | None = None
    truncate_prompt_tokens: Int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # SGLang's name for include_stop_str_in_output (its router sends it on every request).
    no_stop_trim: bool = False
    # vLLM's: braid's fast-tokenizer decoding writes no spaces between special tokens either
    # way, as vLLM's fast path does.
    spaces_between_special_tokens: bool = True
    # structured output: OpenAI's response_format, SGLang's and braid's extras, vLLM's
    # structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    regex: Text | None = None
    json_schema: JsonObject | Text | None = None
    choice: list[Text] | None = None
    ebnf: Text | None = None
    lark: Text | None = None
    grammar: Text | None = None  # EBNF or Lark, told apart
    structural_tag: JsonObject | Text | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # Declared so that they are refused by name (see REFUSED_CONSTRAINT_FIELDS and
    # REFUSED_FIELDS).
    guided_whitespace_pattern: JsonValue = None
    guided_decoding_backend: JsonValue = None
    guided_json_object: JsonValue = None
    use_beam_search: JsonValue = None
    length_penalty: JsonValue = None
    logits_processors: JsonValue = None
    prompt_logprobs: JsonValue = None
    return_tokens_as_token_ids: JsonValue = None
    return_hidden_states: JsonValue = None
    INERT = REFUSED_FIELDS

    def constraint_fields(self) -> dict[str, Any]:
        """The one output constraint of this body, as a `SamplingParams` field; a `ParamError`
        naming the second if two are given."""
        for name, why in REFUSED_CONSTRAINT_FIELDS.items():
            if getattr(self, name) is not None:
                raise ParamError.at(name, f"not supported ({why})")
        given: list[tuple[str, str, Any]] = [
            (name, name, getattr(self, name))
            for name in ("regex", "json_schema", "choice", "ebnf", "lark", "structural_tag")
        ]
        given += [
            ("guided_json", "json_schema", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
        ]
        for name in ("grammar", "guided_grammar"):
            value = getattr(self, name)
            given.append((name, grammar_kind(value) if value is not None else "ebnf", value))
        given = [g for g in given if g[2] is not None]
        if self.structured_outputs is not None:
            given += self.structured_outputs.constraints()
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            given.append(("response_format", *_format_constraint(fmt)))
        if len(given) > 1:
            raise ParamError.at(
                given[1][0], f"give one output constraint, not both {given[0][0]} and {given[1][0]}"
            )
        return {kind: spec for _, kind, spec in given}

    def sampling_params(
        self,
        defaults: SamplingParams,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        names: dict[str, str] | None = None,
        open_ended: bool = False,
    ) -> SamplingParams:
        """`SamplingParams` for this body; a `ParamError` names a bad field, as the body
        spells it (`names`: the body's names of `SamplingParams` fields where they differ).
        `max_tokens` None takes `defaults`' unless `open_ended` (up to the context)."""
        if self.stream_options is not None and not self.stream:
            raise ParamError.at("stream_options", "only with stream: true")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise ParamError.at(
                "stream_options.include_obfuscation", "not supported (braid pads no events)"
            )
        self.refuse_inert()
        fields: dict[str, Any] = dict(
            n=self.n,
            max_tokens=max_tokens if max_tokens is not None or open_ended else defaults.max_tokens,
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
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            **self.constraint_fields(),
        )
        if self.logit_bias is not None:
            try:
                fields["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ParamError("logit_bias", "logit_bias keys must be token ids") from None
        try:
            return SamplingParams(**fields)
        except ParamError as e:
            raise renamed(e, names or {}) from None


def renamed(e: ParamError, names: dict[str, str]) -> ParamError:
    """`e` naming its field as the request spells it (`names`: braid's name -> the body's)."""
    new = names.get(e.param or "")
    if new is None:
        return e
    return ParamError(new, str(e).replace(str(e.param), new, 1))


def _format_constraint(fmt: ResponseFormat) -> tuple[str, Any]:
    if fmt.type == "json_object":
        return "json_schema", {"type": "object"}
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ParamError.at("response_format", "json_schema.schema is required")
        return "json_schema", fmt.json_schema.schema_
    if fmt.structures is None or fmt.triggers is None:
        raise ParamError.at(
            "response_format",
            "a structural_tag takes structures ([{begin, schema, end}]) and triggers",
        )
    return "structural_tag", {"structures": fmt.structures, "triggers": fmt.triggers}


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Int] | list[list[Int]] | list[Text] = Field(union_mode="left_to_right")
    logprobs: Annotated[Int, _doc(minimum=0, maximum=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Int | None = None  # only equal to n (braid returns every sample)
    suffix: Text | None = None  # refused unless empty: braid does not fill in the middle
    # vLLM's: false tokenizes a text prompt without the tokenizer's special tokens (BOS).
    add_special_tokens: bool = True
    # vLLM's beam search: `n` beams per prompt (serving_beam.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    INERT = BEAM_SEARCH_SERVED


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Text
    content: Text | list[JsonObject] | None = None

    @model_validator(mode="after")
    def _check_extra(self) -> ChatMessage:
        check_json_value(self.model_extra or {})
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], _doc(minItems=1)]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[Int, _doc(minimum=0, maximum=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    # Refused unless the server runs with --allow-request-chat-template (see app.py).
    chat_template: Annotated[Text, Field(min_length=1)] | None = None
    # Extra variables for the chat template (vLLM's and SGLang's field), such as Qwen3's
    # enable_thinking; `tokenizer.chat.check_template_kwargs` refuses the names braid sets.
    chat_template_kwargs: JsonObject | None = None
    # vLLM's: leave the last message open for the model to go on with (a prefilled answer),
    # with add_generation_prompt false; documents for a template that shows them (RAG).
    continue_final_message: bool = False
    documents: list[JsonObject] | None = None
    echo: JsonValue = None  # vLLM's chat echo: refused when true (`refuse_unserved`)
    # OpenAI's, refused when they ask for what braid does not do (`refuse_unserved`).
    audio: JsonValue = None
    modalities: JsonValue = None
    functions: JsonValue = None
    function_call: JsonValue = None
    web_search_options: JsonValue = None

    def refuse_unserved(self) -> None:
        """A `ParamError` for a field asking for what braid does not do: audio output, the
        legacy function-calling fields, built-in web search, vLLM's chat echo."""
        if self.echo not in (None, False):
            raise ParamError.at("echo", "not supported on chat (use completions' echo)")
        if self.audio is not None or self.modalities not in (None, ["text"]):
            name = "audio" if self.audio is not None else "modalities"
            raise ParamError.at(name, "braid answers in text only")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise ParamError.at(name, "the legacy fields are not taken; use tools")
        if self.web_search_options is not None:
            raise ParamError.at(
                "web_search_options", "braid runs no built-in tools; declare a function tool"
            )

    # Tool calling: shapes are checked by braid.runtime.function_call, whose errors name the
    # field precisely (tools[i].function.name, tool_choice.function.name, ...).
    tools: list[JsonValue] | None = None
    tool_choice: JsonValue = None
    parallel_tool_calls: JsonValue = True
    # SGLang's: false returns a reasoning model's raw text as content (--reasoning-parser).
    separate_reasoning: bool = True
    # OpenAI's: a template variable, taken where the model's chat template reads it
    # (`serving_chat`); refused elsewhere.
    reasoning_effort: Text | None = None
    # OpenAI's, with no effect on the answer: tags, routing and abuse-tracking hints.
    metadata: dict[Text, Text] | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    # Taken at the values that ask for nothing braid does not do (`INERT`).
    store: JsonValue = None
    service_tier: JsonValue = None
    prompt_cache_retention: JsonValue = None
    prompt_cache_options: JsonValue = None
    verbosity: JsonValue = None
    prediction: JsonValue = None
    moderation: JsonValue = None
    stream_reasoning: JsonValue = True
    # vLLM's beam search: `n` beams (serving_beam.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    INERT = (
        BEAM_SEARCH_SERVED
        | OPENAI_INERT
        | {
            "store": ("braid keeps no completions", (None, False)),
            "service_tier": ("braid has one tier, 'default'", (None, "auto", "default")),
            "verbosity": ("nothing sets how long the model's answers are", (None,)),
            "prediction": ("predicted outputs are not taken", (None,)),
            "stream_reasoning": ("reasoning is streamed as it comes", (True,)),
        }
    )


class EmbeddingRequest(_Body):
    """OpenAI's embeddings body, with vLLM's `normalize` and `truncate_prompt_tokens`. `input`:
    a text, a list of texts, token ids, or a list of token-id lists (one embedding each)."""

    input: list[Int] | list[list[Int]] | Text | list[Text] = Field(union_mode="left_to_right")
    model: Text | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: Text | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: Int | None = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a `prompt`, or chat `messages` rendered as a chat request's.
    `model`: as on the other routes (vLLM's clients send it)."""

    model: Text | None = None
    prompt: Annotated[Text, _doc(minLength=1)] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[JsonValue] | None = None  # as chat's, for the template to show
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: JsonObject | None = None
    return_token_strs: bool = False
    # vLLM's, for a prompt (a chat's template writes its own special tokens).
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[Int]
