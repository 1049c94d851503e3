"""A conversation made a prompt, the one way `LLM.chat` and the server's chat completions both
make it: the messages flattened as chat templates take them (an image part becomes the model's
image placeholder), rendered with the chat template, and tokenized."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from braid.runtime.errors import ParamError
from braid.runtime.multimodal.frontend import flatten_content
from braid.runtime.tokenizer.tokenizer import render_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: its text, token ids, and its images' sources in order (one
    image placeholder in `text` for each)."""

    text: str
    ids: list[int]
    sources: list[Any]


def template_messages(
    messages: list[Any], placeholder: str | None, where: str = "messages"
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The messages as the chat template takes them, list contents flattened to text with each
    image part replaced by `placeholder` (None: the model takes no images), and the images'
    sources in order. A `ParamError` names what is malformed (`where[i].content[j]...`)."""
    out, sources = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ParamError.at(f"{where}[{i}]", "must be a dict with 'role' and 'content'")
        if not isinstance(m.get("content"), list):
            out.append(m)
            continue
        text, found = flatten_content(m["content"], placeholder, f"{where}[{i}].content")
        out.append({**m, "content": text})
        sources += found
    return out, sources


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Any],
    placeholder: str | None,
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
    documents: list[dict[str, Any]] | None = None,
    rendered: str | None = None,
    max_chars: int | None = None,
    where: str = "messages",
) -> ChatPrompt:
    """`messages` (OpenAI's format) as a prompt: flattened (`template_messages`), rendered with
    `chat_template` or the tokenizer's own, given `template_kwargs`, `continue_final_message`
    and `documents` (`render_chat`; or given as `rendered`, a rendering made elsewhere, such
    as the server's template sandbox), and tokenized without added special tokens (the
    template writes them). A `ParamError` naming `where` for malformed messages, a template
    that fails, a rendering longer than `max_chars` (refused before tokenizing) or one with no
    tokens."""
    flat, sources = template_messages(messages, placeholder, where)
    text = rendered
    if text is None:
        text = render_chat(
            tokenizer,
            flat,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            template_kwargs=template_kwargs,
            continue_final_message=continue_final_message,
            documents=documents,
        )
    if max_chars is not None and len(text) > max_chars:
        raise ParamError.at(
            where, f"{len(text)} characters is longer than the context length allows"
        )
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ParamError.at(where, "the rendered conversation is empty")
    return ChatPrompt(text, ids, sources)
