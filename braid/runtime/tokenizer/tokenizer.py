"""Loading a Hugging Face tokenizer and rendering chat conversations with its template."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
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
        self._config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self._clean_up = bool(self._config.get("clean_up_tokenization_spaces", False))

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


_ADDED_TOKEN_FIELDS = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")


class FastVocabulary(FastDecoder):
    """What the grammar compiler reads of a tokenizer (`constrained.vocab.token_vocab`: the
    vocabulary with added tokens, the special ids, EOS, encoding without special tokens),
    straight from tokenizer.json and tokenizer_config.json like `FastDecoder`. The scheduler
    process loads it without importing transformers, which took 2-4 s of its start on the H200
    machine (with bytecode; 8-13 s without).

    Only a config that changes nothing in tokenizer.json is read this way: each token of its
    `added_tokens_decoder`, and each special token it names (every `*_token` entry, then
    `extra_special_tokens`, else `additional_special_tokens`), is already an added token of
    tokenizer.json with the same flags, and neither a Mistral regex fix nor, for a config
    without `added_tokens_decoder`, a special_tokens_map.json or added_tokens.json (each of
    which transformers applies on top). Anything else is a `ValueError`, and `load_vocabulary`
    then loads transformers' tokenizer."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        path, cfg = Path(path), self._config
        if cfg.get("fix_mistral_regex"):
            raise ValueError("fix_mistral_regex: transformers replaces the pre-tokenizer")
        for extra in ("special_tokens_map.json", "added_tokens.json"):
            if "added_tokens_decoder" not in cfg and (path / extra).is_file():
                raise ValueError(f"{extra}: transformers reads it")
        self.added_tokens_decoder = self._tok.get_added_tokens_decoder()
        for tid, token in cfg.get("added_tokens_decoder", {}).items():
            have = self.added_tokens_decoder.get(int(tid))
            if (
                not isinstance(token, dict)
                or have is None
                or any(getattr(have, k) != v for k, v in token.items() if k in _ADDED_TOKEN_FIELDS)
            ):
                raise ValueError(f"added token {tid} ({token!r}) differs from tokenizer.json's")
        named = {
            k: self._special_ids(v)
            for k, v in cfg.items()
            if k.endswith("_token") and isinstance(v, (str, dict))  # not add_bos_token etc.
        }
        extra = cfg.get("extra_special_tokens")
        listed = extra if extra else cfg.get("additional_special_tokens")
        ids = [i for v in named.values() for i in v] + self._special_ids(listed)
        self.all_special_ids = sorted(set(ids))
        self.eos_token_id = named["eos_token"][0] if named.get("eos_token") else None

    def _special_ids(self, value: Any) -> list[int]:
        """The ids of one tokenizer_config.json special-token entry: a token (its text or an
        {"content": ...} dict), a list or a {name: token} map of them, or nothing. `ValueError`
        for a token that is not an added token of tokenizer.json (transformers would add it)."""
        if value is None:
            return []
        if isinstance(value, dict) and "content" not in value:
            value = list(value.values())
        if isinstance(value, list):
            return [i for v in value for i in self._special_ids(v)]
        text = value.get("content") if isinstance(value, dict) else value
        tid = self._tok.token_to_id(text) if isinstance(text, str) else None
        if tid is None or tid not in self.added_tokens_decoder:
            raise ValueError(f"special token {value!r} is not an added token of tokenizer.json")
        return [tid]

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids


def load_vocabulary(path: str | Path):
    """What the grammar compiler needs of the model's tokenizer: a `FastVocabulary` where
    tokenizer.json and tokenizer_config.json exist, the config names an EOS token and changes
    nothing in tokenizer.json (see `FastVocabulary`), else the full transformers tokenizer."""
    path = Path(path)
    if (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file():
        try:
            vocab = FastVocabulary(path)
        except ValueError:
            vocab = None
        if vocab is not None and vocab.eos_token_id is not None:
            return vocab
    return load_tokenizer(path)


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


def word_encoder(tokenizer: PreTrainedTokenizerBase | None) -> Callable[[str], list[int]] | None:
    """Text -> token ids without special tokens (`TokenizerManager.encode_words`), or None
    without a tokenizer."""
    if tokenizer is None:
        return None
    return functools.partial(tokenizer.encode, add_special_tokens=False)


def bad_words_token_ids(
    words: Sequence[str], encode: Callable[[str], list[int]]
) -> list[list[int]]:
    """The token sequences `bad_words` ban, as vLLM makes them: each word as it starts a text,
    and with a leading space where that is another word of as many tokens (a tokenizer that
    spells the space as a token of its own gives no second form). A `ParamError` for a word
    that makes no tokens."""
    seqs: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if not plain:
            raise ParamError("bad_words", f"bad_words: {word!r} makes no tokens")
        spaced = encode(" " + word.lstrip())
        if plain not in seqs:
            seqs.append(plain)
        if len(spaced) == len(plain) and spaced[0] != plain[0] and spaced not in seqs:
            seqs.append(spaced)
    return seqs


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
        _check_message(m, f"messages[{i}]")


def _check_message(m: dict[str, Any], at: str) -> None:
    """A `ParamError` naming what a message gets wrong that a template would render anyway:
    no content where one is needed, a tool result's id that is not a string, malformed tool
    calls. Any role is taken: templates have their own (GLM's "observation", Llama's
    "ipython")."""
    role, content, calls = m["role"], m.get("content"), m.get("tool_calls")
    if not role:
        raise ParamError.at(f"{at}.role", "must not be empty")
    if content is not None and not isinstance(content, (str, list)):
        raise ParamError.at(f"{at}.content", "must be a string or a list of content parts")
    if content is None and not (role == "assistant" and calls):
        raise ParamError.at(f"{at}.content", f"required for a {role} message")
    if not isinstance(m.get("tool_call_id", ""), str):
        raise ParamError.at(f"{at}.tool_call_id", "must be a string")
    if calls is None:
        return
    if role != "assistant" or not isinstance(calls, list):
        raise ParamError.at(f"{at}.tool_calls", "a list, on assistant messages only")
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ParamError.at(f"{at}.tool_calls[{k}].function.name", "required, a string")
        if not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise ParamError.at(f"{at}.tool_calls[{k}].function.arguments", "a JSON string")


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


# `apply_chat_template`'s own arguments: braid sets them (or they change what it returns), so
# a request's template variables may not. The first three have request fields of their own.
_OWN_FIELD = {"add_generation_prompt", "chat_template", "tools"}
_RESERVED_TEMPLATE_KWARGS = _OWN_FIELD | {
    "conversation",
    "messages",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "continue_final_message",
    "sanitize_control_tokens",
}


def check_template_kwargs(kwargs: Any, where: str = "chat_template_kwargs") -> dict[str, Any]:
    """`kwargs` as extra chat-template variables (vLLM's and SGLang's `chat_template_kwargs`,
    such as Qwen3's `enable_thinking`), or a `ParamError` naming `where`: not a dict, or a
    name that braid itself passes to the template. The template decides what a variable does
    (one it never reads has no effect, as in vLLM and SGLang)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ParamError.at(where, "must be an object of template variables")
    for name in kwargs:
        if name in _RESERVED_TEMPLATE_KWARGS:
            own = f"; use the request's {name} field" if name in _OWN_FIELD else ""
            raise ParamError.at(f"{where}.{name}", f"braid sets this argument itself{own}")
    return kwargs


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
    documents: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as prompt text, rendered with `chat_template` or the tokenizer's own.
    `tools` (OpenAI tool dicts) are passed to the template, which decides how to show them;
    messages may include assistant `tool_calls` and `role: "tool"` results; `template_kwargs`
    are extra template variables (`check_template_kwargs`); `documents` (dicts of strings)
    go to a template that shows retrieved documents; `continue_final_message` leaves the
    last message open for the model to go on with (not with `add_generation_prompt`). A
    `ParamError` naming `messages` if they are malformed or the template fails on them."""
    extra = check_template_kwargs(template_kwargs)
    if continue_final_message and add_generation_prompt:
        raise ParamError.at(
            "continue_final_message", "not with add_generation_prompt (set it to false)"
        )
    if documents is not None:
        if "documents" in extra:
            raise ParamError.at("documents", "given twice (also in chat_template_kwargs)")
        extra = {**extra, "documents": documents}
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
            continue_final_message=continue_final_message,
            **extra,
        )
    except Exception as e:  # jinja errors have many types; all mean "bad conversation"
        raise ParamError("messages", f"chat template failed on these messages: {e}") from e


def read_chat_template(value: str, where: str = "--chat-template") -> str:
    """An operator's chat template: the text of the file `value` names, or `value` itself if
    it holds Jinja's characters ("{", "}" or a newline, vLLM's rule); checked to parse. A
    `ValueError` naming `where` for a path that is not a file (a mistyped path used to become
    the template's text) or a template with a syntax error (found here, not on every chat)."""
    import jinja2

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise ValueError(
            f"{where}: {value!r} is not a file (and holds no Jinja tags to be a template itself)"
        )
    try:
        parse_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where}: the template does not parse: {e} (line {e.lineno})") from None
    return text


def parse_template(text: str) -> Any:
    """A chat template's syntax tree, as transformers will read it: with jinja's loop controls,
    and where a tag is unknown to those, in transformers' own environment (which adds tags such
    as `{% generation %}`; imported only then). Raises jinja2's `TemplateSyntaxError`."""
    import jinja2

    try:
        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        if "unknown tag" not in str(e):
            raise
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template("").environment.parse(text)


def template_reads(
    tokenizer: PreTrainedTokenizerBase, chat_template: str | None, name: str
) -> bool:
    """Whether the chat template (`chat_template`, else the tokenizer's default one) reads the
    variable `name`: parsed, not run."""
    template = chat_template or tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default")
    return isinstance(template, str) and name in _template_variables(template)


@functools.lru_cache(maxsize=8)  # the server's template, and a few of requests' own
def _template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from outside (parsed once per template text, not on
    every request that gives reasoning_effort)."""
    import jinja2
    from jinja2 import meta

    try:
        parsed = parse_template(template)
    except jinja2.TemplateSyntaxError:
        return frozenset()
    return frozenset(meta.find_undeclared_variables(parsed))
