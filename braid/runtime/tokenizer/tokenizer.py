"""Loading a Hugging Face tokenizer and rendering chat conversations with its template."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from braid.runtime.errors import ParamError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class FastDecoder:
    """Decoding only, straight from tokenizer.json with the `tokenizers` library: what the
    detokenizer process needs, without importing transformers (over a second at every
    start). Decodes as the transformers fast tokenizer does, including its optional
    clean-up of spaces before punctuation."""

    def __init__(self, path: str | Path) -> None:
        import json

        from tokenizers import Tokenizer

        path = Path(path)
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self._clean_up = bool(cfg.get("clean_up_tokenization_spaces", False))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for a, b in (
                (" .", "."),
                (" ?", "?"),
                (" !", "!"),
                (" ,", ","),
                (" ' ", "'"),
                (" n't", "n't"),
                (" 'm", "'m"),
                (" 's", "'s"),
                (" 've", "'ve"),
                (" 're", "'re"),
            ):
                text = text.replace(a, b)
        return text


def load_decoder(path: str | Path):
    """A decoder for the detokenizer: `FastDecoder` when tokenizer.json exists, else the
    full transformers tokenizer."""
    if (Path(path) / "tokenizer.json").is_file():
        return FastDecoder(path)
    return load_tokenizer(path)


def has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The model's tokenizer. With a tokenizer.json (which defines the whole pipeline) it is
    loaded directly as a fast tokenizer: AutoTokenizer would first import the model's config
    machinery, which costs over a second at every start."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # heavy: only when needed

    try:
        if (Path(path) / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(path))
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ParamError(
            "messages", "messages must be a non-empty list of {'role', 'content'} dicts"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ParamError(
                f"messages[{i}]", f"messages[{i}] must be a dict with a 'role', got {m!r}"
            )
        if not isinstance(m["role"], str):
            raise ParamError(f"messages[{i}].role", f"messages[{i}].role must be a string")


def _for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant message with only tool calls has
    content "" (not None), and tool-call arguments are objects, not the JSON text OpenAI
    sends (templates write them with `tojson`). The caller's dicts are not modified."""
    import json

    out = []
    for m in messages:
        if m.get("content") is None:
            m = {**m, "content": ""}
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"])
                    except ValueError:
                        args = None
                    if isinstance(args, dict):
                        c = {**c, "function": {**fn, "arguments": args}}
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as prompt text, rendered with `chat_template` or the tokenizer's own.
    `tools` (OpenAI tool dicts) are passed to the template, which decides how to show them;
    messages may include assistant `tool_calls` and `role: "tool"` results. A `ParamError`
    naming `messages` if they are malformed or the template fails on them."""
    _check_messages(messages)
    messages = _for_template(messages)
    template = chat_template or tokenizer.chat_template
    if not template:
        raise ValueError(
            "this model's tokenizer has no chat template: pass chat_template=... or use "
            "generate() with plain prompts"
        )
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
            tools=tools,
        )
    except Exception as e:  # jinja errors have many types; all mean "bad conversation"
        raise ParamError("messages", f"chat template failed on these messages: {e}") from e
