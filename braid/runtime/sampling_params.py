"""`SamplingParams`: how to sample one request, validated when made and whenever a field is
set, and shared by every entry point.

Field names and defaults follow vLLM's `SamplingParams`, so code written for it runs unchanged:
its fields may be set after construction (`sp.max_tokens = 5`), and its other spellings
(`structured_outputs`, `guided_decoding`, `seed=-1`, ...) are taken or refused by name. The
class is a frozen dataclass whose `__setattr__` validates the whole again (`_set_field`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from braid.runtime.errors import ParamError

# Largest number of top log-probabilities one token may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# Most `bad_words` one request may give (each is checked on the host at every step).
MAX_BAD_WORDS = 512


# The fields that constrain the output (at most one is given); each is a constraint kind of
# `braid.runtime.constrained.spec`.
CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "ebnf", "lark", "structural_tag")

# Integers travel to the scheduler as 64-bit values.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _too_big(x: object) -> bool:
    return _is_int(x) and not INT64_MIN <= x <= INT64_MAX  # type: ignore[operator]


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one prompt; invalid values raise a `ParamError` (a `ValueError`)
    naming the field.

    `temperature=0` means greedy; a temperature above 0 and below 0.01 samples at 0.01, as
    vLLM's (smaller ones overflow the logits). `top_k` of 0 or -1 turns top-k off.
    `max_tokens=None` generates until a stop condition or the context length; `max_tokens=0`
    only prefills the prompt (its KV is cached, prompt logprobs are scored) and generates
    nothing. `stop` strings end
    generation on the detokenized text (cut before the stop string); `stop_regex` patterns end it
    where a match ends (SGLang's field; the matched text is kept); `stop_token_ids` end it on a
    token (even with `ignore_eos`). `seed` makes the request's
    samples the same whatever batch it lands in. `logprobs=k` returns, for every generated token,
    its log-probability and the `k` most likely alternatives; `prompt_logprobs=k` does the same
    for the prompt; with `logprob_start_len=p` only positions from `p` on are scored (earlier
    ones are None), and the prompt's first `p - 1` tokens may come from the prefix cache (with
    0, the default, every position is scored and nothing is cached). `logit_bias` maps token
    ids to a bias added to their logits. `allowed_token_ids` limits every sampled token to
    those ids; `bad_words` are never generated (each word's tokens, with and without a leading
    space: the last token is banned wherever the output ends with the ones before it; vLLM's
    fields; the engine fills `bad_words_token_ids` from them). `truncate_prompt_tokens=k`
    keeps only the prompt's last k tokens (-1: as many as the context takes with room for
    `max_tokens`; vLLM's field; not with images).
    `json_schema` (a schema dict or JSON string), `regex`, `choice` (a list of strings),
    `ebnf` (a GBNF grammar, root rule `root`: SGLang's field), `lark` (a Lark grammar, start
    rule `start`) or `structural_tag` (SGLang's: free text in which each trigger starts a
    begin tag, a JSON value of its schema and an end tag) constrain the output; at most one of
    them. A constraint the configured grammar backend cannot enforce goes to one that can, or
    the request fails with a `ParamError` naming the field and the keyword.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    # Lists on input (tuples accepted too); stored as tuples.
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_start_len: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # `bad_words` as token ids, one sequence per form of each word: filled by the engine
    # (`tokenizer.bad_words_token_ids`), never by hand.
    bad_words_token_ids: list[list[int]] | None = None
    json_schema: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    ebnf: str | None = None
    lark: str | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        err = self._first_error()
        if err:
            raise ParamError(*err)
        given = [k for k in CONSTRAINT_FIELDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ParamError(
                given[1], f"{given[1]}: give only one of {', '.join(CONSTRAINT_FIELDS)}"
            )
        if given and self.min_tokens:
            raise ParamError("min_tokens", f"min_tokens: cannot be combined with {given[0]}")
        for name in ("allowed_token_ids", "bad_words"):
            # A grammar that allows only tokens these ban would leave nothing to sample.
            if given and getattr(self, name) is not None:
                raise ParamError(name, f"{name}: cannot be combined with {given[0]}")
        if given:
            from braid.runtime.constrained.spec import check_spec

            # Raises a ParamError naming the field; JSON specs are stored as text.
            object.__setattr__(self, given[0], check_spec(given[0], getattr(self, given[0])))
        # Normalise containers so the object never aliases the caller's lists.
        for name in ("stop", "stop_regex"):  # one string or a list of them -> a tuple
            value = getattr(self, name)
            object.__setattr__(
                self, name, (value,) if isinstance(value, str) else tuple(value or ())
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.allowed_token_ids is not None:  # each id once, in order: at most the vocabulary
            allowed = tuple(sorted(set(self.allowed_token_ids)))
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.bad_words is not None:
            object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if self.bad_words_token_ids is not None:
            ids = tuple(tuple(w) for w in self.bad_words_token_ids)
            object.__setattr__(self, "bad_words_token_ids", ids)
        if self.logit_bias is not None:
            object.__setattr__(
                self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()}
            )

    def _first_error(self) -> tuple[str, str] | None:  # noqa: C901 - one flat list reads best
        """(field, message) of the first invalid value, or None."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            values = v if isinstance(v, (list, tuple)) else [v]
            if any(_too_big(x) for x in values):
                return f.name, f"{f.name}: {v!r} is out of range (integers must fit in 64 bits)"
        if not _is_int(self.n) or self.n < 1:
            return "n", f"n must be an integer >= 1, got {self.n!r}"
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            return (
                "max_tokens",
                f"max_tokens must be an integer >= 0 or None, got {self.max_tokens!r}",
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            return "min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            return "min_tokens", (
                f"min_tokens ({self.min_tokens}) must not be greater than "
                f"max_tokens ({self.max_tokens})"
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            return (
                "temperature",
                f"temperature must be a non-negative number, got {self.temperature!r}",
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            return "top_p", f"top_p must be in (0, 1], got {self.top_p!r}"
        if not _is_int(self.top_k) or self.top_k < -1:
            return (
                "top_k",
                f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}",
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            return "min_p", f"min_p must be in [0, 1], got {self.min_p!r}"
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            return (
                "repetition_penalty",
                f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                return name, f"{name} must be in [-2, 2], got {v!r}"
        if self.seed is not None and not _is_int(self.seed):
            return "seed", f"seed must be an integer or None, got {self.seed!r}"
        stop = self.stop
        if stop is not None:
            items = [stop] if isinstance(stop, str) else stop
            if not isinstance(items, (list, tuple)) or not all(
                isinstance(s, str) and s for s in items
            ):
                return "stop", f"stop must be a non-empty string or a list of them, got {stop!r}"
        if self.stop_regex is not None:
            items = [self.stop_regex] if isinstance(self.stop_regex, str) else self.stop_regex
            if not isinstance(items, (list, tuple)) or not all(
                isinstance(s, str) and s for s in items
            ):
                return (
                    "stop_regex",
                    f"stop_regex must be a non-empty string or a list of them, got {items!r}",
                )
            for pattern in items:
                try:
                    if re.compile(pattern).match(""):
                        return "stop_regex", f"stop_regex {pattern!r} matches the empty string"
                except re.error as e:
                    return "stop_regex", f"stop_regex {pattern!r} is not a valid regex: {e}"
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids
            ):
                return "stop_token_ids", (
                    "stop_token_ids must be a list of non-negative integers, "
                    f"got {self.stop_token_ids!r}"
                )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                return name, f"{name} must be a bool, got {getattr(self, name)!r}"
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                return name, f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {v!r}"
        if not _is_int(self.logprob_start_len) or self.logprob_start_len < 0:
            v = self.logprob_start_len
            return (
                "logprob_start_len",
                f"logprob_start_len must be a non-negative integer, got {v!r}",
            )
        err = self._list_error()
        if err:
            return err
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                return (
                    "logit_bias",
                    f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}",
                )
            for k, v in self.logit_bias.items():
                # An int, or its digits as OpenAI's JSON keys are (1.7 or True is no token id).
                if not (_is_int(k) or isinstance(k, str) and k.strip().lstrip("-").isdigit()):
                    return "logit_bias", f"logit_bias keys must be token ids, got {k!r}"
                tok = int(k)
                if tok < 0:
                    return (
                        "logit_bias",
                        f"logit_bias keys must be non-negative token ids, got {k!r}",
                    )
                if not _is_number(v) or not -100 <= v <= 100:
                    return (
                        "logit_bias",
                        f"logit_bias values must be in [-100, 100], got {v!r} for token {k}",
                    )
        return None

    def prompt_keep(self, context_length: int) -> int | None:
        """How many of the prompt's last tokens `truncate_prompt_tokens` keeps (None: all);
        -1 keeps what leaves room for `max_tokens` (at least one) in the context. A
        `ParamError` for a value past the context length (as vLLM's)."""
        k = self.truncate_prompt_tokens
        if k is not None and k > context_length:
            raise ParamError.at(
                "truncate_prompt_tokens",
                f"{k} is greater than the context length ({context_length})",
            )
        if k != -1:
            return k
        return max(1, context_length - max(1, self.max_tokens or 1))

    def prompt_tail(self, ids: list[int], context_length: int, images: bool) -> list[int]:
        """`ids` cut to what `truncate_prompt_tokens` keeps (`prompt_keep`); a `ParamError`
        for a prompt with images (a cut would split an image's tokens; its ids also grow when
        they go in)."""
        k = self.prompt_keep(context_length)
        if k is not None and images:
            raise ParamError("truncate_prompt_tokens", "truncate_prompt_tokens: not with images")
        return ids if k is None or len(ids) <= k else ids[-k:]

    def _list_error(self) -> tuple[str, str] | None:
        """(field, message) of the first invalid value among the token and word lists."""
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, (list, tuple))
            or not allowed
            or not all(_is_int(t) and t >= 0 for t in allowed)
        ):
            return "allowed_token_ids", (
                f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}"
            )
        words = self.bad_words
        if words is not None and (
            not isinstance(words, (list, tuple))
            or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            return "bad_words", f"bad_words must be a list of non-blank strings, got {words!r}"
        if words is not None and len(words) > MAX_BAD_WORDS:
            # Each is matched against the output's tail on the host at every step.
            return "bad_words", f"bad_words: {len(words)} words, at most {MAX_BAD_WORDS}"
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            return "truncate_prompt_tokens", (
                "truncate_prompt_tokens must be an integer >= 1, -1 (the most the context "
                f"takes) or None, got {k!r}"
            )
        seqs = self.bad_words_token_ids
        if seqs is not None and (
            not isinstance(seqs, (list, tuple))
            or not all(
                isinstance(w, (list, tuple)) and w and all(_is_int(t) and t >= 0 for t in w)
                for w in seqs
            )
        ):
            return "bad_words_token_ids", (
                f"bad_words_token_ids must be lists of token ids, got {seqs!r}"
            )
        return None

    @property
    def constraint(self) -> tuple[str, str | tuple[str, ...]] | None:
        """(kind, spec) of the output constraint, if any."""
        for kind in CONSTRAINT_FIELDS:
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether a repetition, frequency or presence penalty applies (they read the tokens
        generated so far)."""
        return self.repetition_penalty != 1.0 or bool(
            self.frequency_penalty or self.presence_penalty
        )

    @property
    def reads_output(self) -> bool:
        """Whether sampling reads the tokens generated so far (the penalties, and bad words of
        more than one token), so a step may not run ahead of reading the last one back."""
        return self.penalized or any(len(w) > 1 for w in self.bad_words_token_ids or ())

    @property
    def masks_tokens(self) -> bool:
        """Whether the sampler edits the logits for `allowed_token_ids` or bad words."""
        return bool(self.allowed_token_ids or self.bad_words_token_ids)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise a `ParamError` if a token id in these params is outside the model's
        vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ParamError(
                    "stop_token_ids",
                    f"stop_token_ids: {t} is outside the vocabulary ({vocab_size})",
                )
        for t in self.logit_bias or {}:
            if t >= vocab_size:
                raise ParamError(
                    "logit_bias", f"logit_bias: token {t} is outside the vocabulary ({vocab_size})"
                )
        for word in self.bad_words_token_ids or ():
            if max(word) >= vocab_size:
                raise ParamError(
                    "bad_words",
                    f"bad_words: token {max(word)} is outside the vocabulary ({vocab_size})",
                )
        for t in self.allowed_token_ids or ():
            if t >= vocab_size:
                raise ParamError(
                    "allowed_token_ids",
                    f"allowed_token_ids: {t} is outside the vocabulary ({vocab_size})",
                )

    def check_something_to_sample(self, stop_ids: frozenset[int]) -> None:
        """Raise a `ParamError` if `allowed_token_ids` leaves no token to sample: every one
        banned by a one-token bad word, or (while `min_tokens` holds the stop tokens back,
        `stop_ids` with the model's EOS) every one a stop token."""
        if not self.allowed_token_ids:
            return
        allowed = set(self.allowed_token_ids)
        banned = {w[0] for w in self.bad_words_token_ids or () if len(w) == 1}
        if allowed <= banned:
            raise ParamError("bad_words", "bad_words: ban every token in allowed_token_ids")
        if self.min_tokens and allowed <= banned | stop_ids | set(self.stop_token_ids):
            raise ParamError(
                "min_tokens",
                "min_tokens: allowed_token_ids holds only stop tokens, which min_tokens bans",
            )


# Fields a model's generation_config.json may set as defaults (the ones vLLM takes from it).
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def defaults_from_generation_config(gen_config: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams defaults that a model's generation_config.json asks for."""
    out = {}
    for src, dst in GENERATION_CONFIG_FIELDS.items():
        if gen_config.get(src) is not None:
            out[dst] = gen_config[src]
    return out


def fold_seed(seed: int) -> int:
    """A 32-bit stream id for any Python int seed (the sampler's noise stream of a sample;
    here, beside the parameters, so the front end computes it without importing torch)."""
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


# ---- vLLM's spellings: fields braid takes under another name, or as they mean nothing here ----
# vLLM's structured-output keys -> braid's constraint fields.
STRUCTURED_OUTPUT_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "ebnf",
    "structural_tag": "structural_tag",
}


def _structured(value: Any, name: str) -> dict[str, Any]:
    """vLLM's `structured_outputs` / `guided_decoding` (a dict or its params object) as
    braid's constraint fields; a `ParamError` naming what braid cannot take."""
    if value is None:
        return {}
    given = value if isinstance(value, dict) else vars(value)
    out: dict[str, Any] = {}
    for key, v in given.items():
        if v is None or v is False or key.startswith("_"):
            continue
        if key in STRUCTURED_OUTPUT_KEYS:
            out[STRUCTURED_OUTPUT_KEYS[key]] = v
        elif key == "json_object":
            out["json_schema"] = {"type": "object"}
        elif key in ("backend", "backend_was_auto"):
            continue  # which of vLLM's engines compiles it: braid's --grammar-backend decides
        elif key == "disable_any_whitespace":
            # braid's JSON never has free whitespace: every backend writes json.dumps's
            # separators (", ", ": "), as xgrammar does in vLLM with this flag set.
            continue
        else:
            known = sorted([*STRUCTURED_OUTPUT_KEYS, "json_object"])
            raise ParamError(name, f"{name}.{key} is not supported (braid takes {known})")
    return out


def _vllm_fields(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with vLLM's other spellings made braid's: `structured_outputs` /
    `guided_decoding` as the constraint fields, `seed=-1` as no seed, and the fields that
    change nothing in braid at their values (`detokenize=True`, `spaces_between_special_tokens`
    (a fast tokenizer ignores it, in vLLM too), `output_kind`: offline outputs are final, as
    vLLM's `LLM` makes them; `extra_args` empty) dropped; any other unknown name, or one of
    those at a value braid cannot honour, is a `ParamError` naming it."""
    out = dict(kwargs)
    for name in ("structured_outputs", "guided_decoding"):
        if name in out:
            for field, value in _structured(out.pop(name), name).items():
                given = [k for k in CONSTRAINT_FIELDS if out.get(k) is not None]
                if given:
                    raise ParamError(
                        name, f"{name}: give only one constraint ({given[0]} is given too)"
                    )
                out[field] = value
    if out.get("seed") == -1:
        out["seed"] = None
    if "detokenize" in out and out.pop("detokenize") is not True:
        raise ParamError("detokenize", "detokenize: braid supports only True")
    # Changes nothing with a fast tokenizer, in vLLM too (the server takes it the same way).
    out.pop("spaces_between_special_tokens", None)
    out.pop("output_kind", None)
    if out.pop("extra_args", None):
        raise ParamError("extra_args", "extra_args: braid has no per-request extensions")
    unknown = sorted(set(out) - _FIELD_NAMES)
    if unknown:
        name = unknown[0]
        if name == "logits_processors":
            raise ParamError(name, "logits_processors: braid runs no per-request Python code")
        raise ParamError(name, f"SamplingParams has no field {name!r}")
    return out


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# vLLM's names that `_vllm_fields` takes (and maps, drops or refuses) on construction and set.
_VLLM_ONLY = frozenset(
    (
        "structured_outputs",
        "guided_decoding",
        "detokenize",
        "spaces_between_special_tokens",
        "output_kind",
        "extra_args",
        "logits_processors",
    )
)
_dataclass_init = SamplingParams.__init__


def _init(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    _dataclass_init(self, *args, **_vllm_fields(kwargs))


def _set_field(self: SamplingParams, name: str, value: Any) -> None:
    """Setting a field, as vLLM's mutable params allow (`sp = llm.get_default_sampling_params();
    sp.max_tokens = 5`), validates the whole again (a `ParamError` naming the field leaves the
    object as it was) and normalises it as construction does."""
    if name not in _FIELD_NAMES and name not in _VLLM_ONLY:
        raise AttributeError(f"SamplingParams has no field {name!r}")
    changes = _vllm_fields({name: value})  # vLLM's spellings, as at construction
    if name in ("structured_outputs", "guided_decoding"):
        changes.update({k: None for k in CONSTRAINT_FIELDS if k not in changes})
    if name == "bad_words":  # the engine makes the token ids again from the new words
        changes["bad_words_token_ids"] = None
    new = dataclasses.replace(self, **changes)
    self.__dict__.update(new.__dict__)  # every field at once: a reader sees old or new


SamplingParams.__init__ = _init  # type: ignore[method-assign]
SamplingParams.__setattr__ = _set_field  # type: ignore[method-assign]
SamplingParams.__hash__ = None  # type: ignore[assignment]  # settable: not a dict key
