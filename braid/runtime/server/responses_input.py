"""The body of `POST /v1/responses` and what it means in chat terms: its input items become
chat messages, its function tools and `tool_choice` become chat's, `text.format` becomes a
`response_format`, and the whole becomes one `ChatCompletionRequest` that braid's chat path
renders, constrains and runs.

What braid cannot do is refused with a 400 naming the field, never dropped: built-in tools
(web_search, file_search, ...), `background`, `conversation`, stored prompts, input item types
other than messages, function calls and their outputs and reasoning, and so on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, ValidationError

from braid.runtime.server.guard import APIError
from braid.runtime.server.inputs import _validation_error
from braid.runtime.server.protocol import (
    OPENAI_INERT,
    ChatCompletionRequest,
    Int,
    JsonObject,
    JsonValue,
    Name,
    Text,
    _Body,
    _doc,
)

# Tool types OpenAI runs on its side (or the client's computer); braid runs no tool.
_HOSTED = "braid runs no built-in tools; declare a function tool and run it yourself"


class TextConfig(_Body):
    format: JsonObject | None = None
    verbosity: Text | None = None


class ResponsesStreamOptions(_Body):
    # OpenAI's padding of stream events against length side channels: braid adds none.
    include_obfuscation: bool = False


class ResponsesRequest(_Body):
    """OpenAI's `POST /v1/responses` body, and braid's sampling extras (`extra_body`)."""

    model: Text | None = None
    input: Text | list[JsonObject] = Field(union_mode="left_to_right")
    instructions: Text | None = None
    max_output_tokens: Annotated[Int, _doc(minimum=1)] | None = None
    temperature: Annotated[float, _doc(minimum=0, maximum=2)] | None = None
    top_p: Annotated[float, _doc(exclusiveMinimum=0, maximum=1)] | None = None
    text: TextConfig | None = None
    tools: list[JsonObject] | None = None
    tool_choice: JsonValue = None
    parallel_tool_calls: bool = True
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    previous_response_id: Text | None = None
    metadata: dict[Text, Text] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    service_tier: Text | None = None
    truncation: Text | None = None
    # Declared so that a value braid cannot honour is refused by name (see `refusals`).
    reasoning: JsonObject | None = None
    include: list[Text] | None = None
    top_logprobs: Int | None = None
    max_tool_calls: Int | None = None
    background: bool | None = None
    conversation: JsonValue = None
    prompt: JsonValue = None
    access_programs: JsonValue = None
    background_options: JsonValue = None
    context_management: JsonValue = None
    image: JsonValue = None
    moderation: JsonValue = None
    prompt_cache_options: JsonValue = None
    prompt_cache_retention: JsonValue = None
    INERT = OPENAI_INERT | {
        "access_programs": ("braid runs no access programs", (None,)),
        "background_options": ("background responses are not supported", (None,)),
        "context_management": ("braid does not compact the context; send what fits", (None,)),
        "image": ("braid makes no images", (None,)),
    }
    # braid's extras, as on chat completions
    cache_salt: Name | None = None
    priority: Int = 0  # vLLM's, under --schedule-policy priority
    seed: Int | None = None
    top_k: Int | None = None
    min_p: Annotated[float, _doc(minimum=0, maximum=1)] | None = None
    repetition_penalty: float | None = None
    stop: Text | list[Text] | None = None
    regex: Text | None = None

    def refusals(self) -> None:
        """An `APIError` for the first field whose value braid cannot honour."""
        if self.temperature is not None and self.temperature > 2:
            _refuse("temperature", f"{self.temperature} is above 2 (OpenAI's range is 0 to 2)")
        if self.background:
            _refuse("background", "background responses are not supported; leave it false")
        if self.conversation is not None:
            _refuse("conversation", "not supported; chain responses with previous_response_id")
        if self.prompt is not None:
            _refuse("prompt", "stored prompt templates are not supported; send the input")
        if self.include:
            _refuse("include", f"{self.include[0]!r} is not something braid can include")
        if self.top_logprobs:
            _refuse("top_logprobs", "logprobs are not served on /v1/responses; use chat")
        if self.max_tool_calls is not None:
            _refuse("max_tool_calls", "not supported; limit calls with parallel_tool_calls")
        if self.truncation not in (None, "disabled"):
            _refuse("truncation", "only 'disabled': braid does not drop input to fit")
        if self.service_tier not in (None, "auto", "default"):
            _refuse("service_tier", f"{self.service_tier!r}: braid has one tier, 'default'")
        if self.text is not None and self.text.verbosity is not None:
            _refuse("text.verbosity", "not supported")
        for key, value in (self.reasoning or {}).items():
            if value is not None and key != "effort":  # effort: chat's reasoning_effort
                _refuse(
                    f"reasoning.{key}",
                    "not supported: a reasoning model's thinking is returned whole as a "
                    "reasoning item (--reasoning-parser), with no effort setting or summary",
                )
        if self.stream_options and not self.stream:
            _refuse("stream_options", "only with stream: true")
        if self.stream_options and self.stream_options.include_obfuscation:
            _refuse("stream_options.include_obfuscation", "not supported (braid pads no events)")
        self.refuse_inert()


def _refuse(param: str, why: str) -> None:
    raise APIError(400, f"{param}: {why}", param)


# ---- input items -> chat messages ---------------------------------------------------------
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages: a text is one user message; items are messages,
    function calls (assistant tool calls; consecutive ones join one message) and function call
    outputs (tool messages). Reasoning items are taken and not rendered: chat templates drop
    earlier turns' thinking."""
    if isinstance(body.input, str):
        if not body.input:
            _refuse("input", "must not be empty")
        return [{"role": "user", "content": body.input}]
    if not body.input:
        _refuse("input", "must not be empty")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where, empty=True),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                _refuse(f"{where}.output", "must be a string (the function's result)")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": output,
                }
            )
        elif kind == "reasoning":
            continue
        else:
            _refuse(
                f"{where}.type",
                f"{kind!r} items are not supported (braid takes message, function_call, "
                "function_call_output and reasoning items)",
            )
    return messages


def _string(item: Mapping[str, Any], key: str, where: str, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty):
        _refuse(f"{where}.{key}", "required, a non-empty string" if not empty else "a string")
    return value  # type: ignore[return-value]


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        _refuse(f"{where}.role", f"{role!r} is not one of {sorted(_ROLES)}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": _ROLES[role], "content": content}
    if not isinstance(content, list):
        _refuse(f"{where}.content", "a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):  # type: ignore[arg-type]
        at = f"{where}.content[{k}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": _string(part, "text", at, empty=True)})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                _refuse(f"{at}.image_url", "required (a URL or data URL; file ids are not taken)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            _refuse(
                f"{at}.type",
                f"{kind!r} content parts are not supported (input_text, output_text, "
                "input_image are)",
            )
    if all(p["type"] == "text" for p in parts):
        return {"role": _ROLES[role], "content": "".join(p["text"] for p in parts)}
    return {"role": _ROLES[role], "content": parts}


# ---- tools, tool_choice, text.format --------------------------------------------------------
def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (`{"type": "function", "name", "parameters", ...}`) in chat's
    shape; any other tool type is refused."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type")
        if kind != "function":
            _refuse(f"tools[{i}].type", f"{kind!r}: {_HOSTED}")
        keys = ("name", "description", "parameters", "strict")
        fn = {k: t[k] for k in keys if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses' `tool_choice` in chat's shape: the strings as they are, and `{"type":
    "function", "name": N}` as `{"type": "function", "function": {"name": N}}`."""
    if choice is None or isinstance(choice, str):
        return choice
    if not isinstance(choice, Mapping):
        _refuse("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', ...}")
    if choice.get("type") != "function":
        _refuse("tool_choice.type", f"{choice.get('type')!r}: only function tools are run")
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        _refuse("tool_choice.name", "required, a non-empty string")
    return {"type": "function", "function": {"name": name}}


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        _refuse("text.format.type", f"{kind!r} is not 'text', 'json_object' or 'json_schema'")
    schema = fmt.get("schema")
    if not isinstance(schema, Mapping):
        _refuse("text.format.schema", "required, a JSON schema object")
    spec: dict[str, Any] = {"schema": schema}
    if fmt.get("name") is not None:
        if not isinstance(fmt["name"], str):
            _refuse("text.format.name", "must be a string")
        spec["name"] = fmt["name"]
    return {"type": "json_schema", "json_schema": spec}


def chat_request(
    body: ResponsesRequest, history: list[dict[str, Any]], messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that runs `body`: the instructions as the system message, then the
    `history` a previous response ended, then this request's input `messages`."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "messages": system + history + messages,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens,
        "response_format": response_format(body.text),
    }
    for name in (
        "temperature",
        "top_p",
        "seed",
        "top_k",
        "min_p",
        "repetition_penalty",
        "cache_salt",
        "priority",
    ):
        fields[name] = getattr(body, name)
    fields["stop"], fields["regex"] = body.stop, body.regex
    fields["reasoning_effort"] = (body.reasoning or {}).get("effort")
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}, strict=False
        )
    except ValidationError as e:
        raise _validation_error(e) from None
