"""What every route does to its input before anything runs: parse and validate the JSON body,
check the model name, tokenize the prompts, and refuse what the runtime would refuse. Each
problem is an `APIError` (400, or 404 for a model name) or a `ParamError` from the runtime's
own checks (a 400 too); each names the field at fault as data (`param`), and its message starts
with the field. A prompt's field is its name, with an index for one prompt of several
("prompt[1]")."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from braid.runtime.errors import ParamError
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.server.guard import APIError
from braid.runtime.server.state import ServerState


# ---- bodies -------------------------------------------------------------------------------
async def _raw_body(request: Request) -> bytes:
    return await request.body()


def _validation_error(e: ValidationError) -> APIError:
    first = e.errors()[0] if e.errors() else {}
    names: list[str] = []  # the field's path; pydantic's union-member tags are left out
    for x in first.get("loc", []):
        if isinstance(x, int) and names:
            names[-1] += f"[{x}]"
        elif isinstance(x, str) and x.isidentifier():
            names.append(x)
    param = ".".join(names) or None
    if first.get("type") == "extra_forbidden":  # in OpenAI's words, and where to look
        return APIError(
            400, f"Unrecognized request argument supplied: {param} (see docs/server.md)", param
        )
    what = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"{param or 'body'}: {what}", param)


def _decode_json(raw: bytes) -> Any:
    """`json.loads(raw)`, about 3x faster for large bodies: msgspec decodes first (a 1M-id
    prompt in 44 ms instead of 127 ms, time in which the GIL, so the event loop, is held), and
    whatever msgspec refuses goes to `json.loads`, so what is accepted and every error stay
    exactly json's (lone surrogates, integers past 64 bits, NaN, nesting)."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return json.loads(raw)


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """`raw` as a `model`; an `APIError` (400) names what is wrong."""
    try:
        data = _decode_json(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8") from None
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


def json_body(model: type[BaseModel]) -> Any:
    """A dependency: the JSON body parsed and validated as `model` on a worker thread (FastAPI
    runs plain functions off the event loop). JSON decoding and pydantic hold the GIL while they
    run, so this bounds, not removes, what a large body costs the loop (see docs/server.md).
    FastAPI cannot see the body's model through it: a route declares it with
    `openapi.takes(model)`."""

    def parse(raw: bytes = Depends(_raw_body)) -> Any:
        return parse_body(model, raw)

    return Depends(parse)


# ---- model names and prompts ----------------------------------------------------------------
def check_model(state: ServerState, model: str | None, strict: bool = False) -> None:
    """As SGLang does, a server serves its one model whatever name a request gives (empty,
    another alias, a path): clients written for another server work unchanged. With
    `--strict-model-name` (or `strict`), any name but the served name (or the model path) is
    a 404."""
    if not (strict or state.strict_model_name) or model is None:
        return
    if model not in (state.served_model_name, state.model_path):
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.served_model_name!r}",
            "model",
            "model_not_found",
        )


def encode_prompt(
    state: ServerState, text: str, where: str, add_special_tokens: bool = True
) -> list[int]:
    """`text`'s token ids; a text that cannot fit the context is refused before tokenizing."""
    if len(text) > state.max_prompt_chars:
        raise APIError(
            400,
            f"{where}: {len(text)} characters is longer than the context length allows "
            f"({state.tm.ready.context_length} tokens)",
            where,
        )
    return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tokenize_prompts(
    state: ServerState, prompt: Any, where: str = "prompt", add_special_tokens: bool = True
) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each prompt in `prompt`: a text, a list of token ids, or a
    list of either; texts tokenized with the tokenizer's special tokens (BOS) unless
    `add_special_tokens` is false (vLLM's field)."""
    one = isinstance(prompt, str) or bool(prompt) and all(isinstance(t, int) for t in prompt)
    if one:
        prompt = [prompt]
    if not prompt:
        raise APIError(400, f"{where}: must not be empty", where)
    if len(prompt) > state.max_samples:
        raise APIError(
            400,
            f"{where}: {len(prompt)} prompts is more than this server takes in one request "
            f"({state.max_samples}; --max-samples-per-request)",
            where,
        )
    out = []
    for i, p in enumerate(prompt):
        at = where if one else f"{where}[{i}]"
        if isinstance(p, str):
            if not p:
                raise APIError(400, f"{at}: must not be empty", at)
            if state.tokenizer is None:
                raise APIError(400, f"{at}: this model has no tokenizer; send token ids", at)
            out.append((p, encode_prompt(state, p, at, add_special_tokens)))
        else:
            out.append((None, list(p)))
    return out


def _check_fan_out(state: ServerState, each: list[SamplingParams]) -> None:
    total = sum(p.n for p in each)
    if total > state.max_samples:
        n = each[0].n
        shown = f"{n} samples x {len(each)} prompts" if len(each) > 1 else f"{n} samples"
        if any(p.n != n for p in each):
            shown = f"{total} samples over {len(each)} prompts"
        raise APIError(
            400,
            f"n: {shown} is more than this server runs for one request "
            f"({state.max_samples}; --max-samples-per-request)",
            "n",
        )


def validate_prompts(
    state: ServerState,
    prompts: list,
    params: SamplingParams | list[SamplingParams],
    where: str,
    *,
    images: bool | list[bool] = False,
    max_tokens_field: str | None | list[str | None] = None,
) -> list:
    """The prompts as they run (each cut to its last `truncate_prompt_tokens` tokens), having
    refused what the scheduler would refuse: more samples than the server runs for one request
    (`APIError`), a prompt too long for the context or a token id outside the vocabulary
    (`ParamError`). `params` is one for every prompt or a list, one per prompt; `images`:
    whether the prompts (all, or each) hold images (whose tokens a cut would split: refused).
    `max_tokens_field`: the body's field that gave the params' `max_tokens` (one for all, or
    one per prompt), refused when the prompt leaves less room in the context (as vLLM's server
    and SGLang do); None where the value is a default, which the context cuts short."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    with_images = images if isinstance(images, list) else [images] * len(prompts)
    fields = (
        max_tokens_field if isinstance(max_tokens_field, list) else [max_tokens_field] * len(each)
    )
    _check_fan_out(state, each)
    out = []
    for i, ((text, ids), p) in enumerate(zip(prompts, each)):
        ids = p.prompt_tail(ids, state.tm.ready.context_length, with_images[i])
        state.tm.validate(ids, p, where=where if len(prompts) == 1 else f"{where}[{i}]")
        if fields[i] is not None:
            _check_room(state, len(ids), p.max_tokens, fields[i])
        out.append((text, ids))
    return out


def _check_room(state: ServerState, prompt_len: int, max_tokens: int | None, field: str) -> None:
    """A `ParamError` naming `field` if `max_tokens` does not fit in the context after a
    prompt of `prompt_len` tokens."""
    context = state.tm.ready.context_length
    if max_tokens is not None and prompt_len + max_tokens > context:
        raise ParamError.at(
            field,
            f"{max_tokens} is too large: the context length is {context} tokens and the prompt "
            f"has {prompt_len}, which leaves room for {context - prompt_len}",
        )
