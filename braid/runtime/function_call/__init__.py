"""Tool calling: parsers of the models' call formats (a registry of lazily imported
factories), streaming tool-call deltas, and what `tools` / `tool_choice` mean for a request.

    parser_cls = get_parser("hermes")
    content, calls = parser_cls.parse(model_text, tools)      # whole text
    p = parser_cls(tools)                                      # or as it streams
    for piece in pieces: send(p.feed(piece))
    send(p.finish())
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from braid.runtime.registry import Registry

if TYPE_CHECKING:
    from braid.runtime.function_call.base import ToolParser

PARSERS: Registry[type[ToolParser]] = Registry(
    "tool_call_parser",
    {
        "hermes": "braid.runtime.function_call.hermes",
        "llama3": "braid.runtime.function_call.llama3",
        "mistral": "braid.runtime.function_call.mistral",
        "pythonic": "braid.runtime.function_call.pythonic",
    },
    unknown="{kind}: {name!r} is unknown (have {known})",
)

PARSER_NAMES = tuple(PARSERS.names())


def get_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; `ValueError` naming the field if unknown."""
    return PARSERS.get(name)


# Markers a chat template writes when it teaches the model a call format, most specific first.
_TEMPLATE_MARKERS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("[func_name1(", "pythonic"),
    ("<|python_tag|>", "llama3"),
)


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template asks for, judged by the call markers it contains; None if it
    shows no known format (e.g. a template that ignores `tools`)."""
    if not chat_template:
        return None
    for marker, name in _TEMPLATE_MARKERS:
        if marker in chat_template:
            return name
    return None


def resolve_parser_name(setting: str | None, chat_template: str | None) -> str | None:
    """`--tool-call-parser` as given: "auto" detects from the template, "none" (or None)
    turns parsing off, any other value must be a registered parser."""
    if setting is None or setting == "none":
        return None
    if setting == "auto":
        return detect_parser(chat_template)
    get_parser(setting)
    return setting
