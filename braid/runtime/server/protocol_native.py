"""SGLang's native request bodies: `/generate` (with its program-session fields and the fields
SGLang's router adds), `/abort_request`, `/open_session`, `/close_session`, `/end_program`,
and how `/generate`'s `sampling_params` become `SamplingParams`. Closed and strict, as the OpenAI
bodies of `protocol`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field

from braid.runtime.errors import ParamError
from braid.runtime.sampling_params import INT64_MAX, MAX_LOGPROBS, SamplingParams
from braid.runtime.server.protocol import (
    Int,
    JsonObject,
    JsonValue,
    Name,
    Text,
    _Body,
    renamed,
)

# A session pin's time-to-live in seconds (the server caps it at its --session-ttl-s).
SessionTTL = Annotated[float, Field(gt=0, le=1e9, allow_inf_nan=False)]
# The alternatives returned with each token's logprob; where prompt logprobs start (-1: none).
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
LogprobStart = Annotated[int, Field(ge=-1, le=INT64_MAX)]
# A call's position in its program: 0 for the program's first gen or select, then 1, ...
ProgramPosition = Annotated[int, Field(ge=0, le=INT64_MAX)]


class SessionParams(_Body):
    """SGLang's `session_params`: the session's id; for a session opened with /open_session,
    the request it continues (`rid`), where that request's sequence is cut (`offset`), whether
    its output is left out (`drop_previous_output`) and whether this request replaces its other
    continuations (`replace`) (`session_trees`); braid's additions: the pin's TTL and the
    call's position in its program."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: Annotated[Text, Field(min_length=1, max_length=256)]
    ttl: SessionTTL | None = None
    position: ProgramPosition | None = None
    rid: Name | None = None
    offset: Annotated[int, Field(ge=-INT64_MAX, le=INT64_MAX)] | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None


class OpenSessionRequest(_Body):
    """SGLang's /open_session body: the session's id (default: a new one) and its capacity
    (kept for SGLang clients: a session's prompts are bounded by the context length)."""

    capacity_of_str_len: Annotated[int, Field(gt=0, le=INT64_MAX)]
    session_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = None


class GenerateRequest(_Body):
    """SGLang's native /generate body (its router adds the fields at the end, at their
    defaults)."""

    text: Text | list[Text] | None = Field(None, union_mode="left_to_right")
    input_ids: list[Int] | list[list[Int]] | None = Field(None, union_mode="left_to_right")
    # For a batch, each of these may also be a list with one entry per prompt (SGLang's
    # shapes); a single value applies to every prompt.
    sampling_params: JsonObject | list[JsonObject] = Field(
        default_factory=dict, union_mode="left_to_right"
    )
    stream: bool = False
    return_logprob: bool | list[bool] = False
    top_logprobs_num: TopLogprobs | list[TopLogprobs] = 0
    # Token texts are always in the logprob entries; accepted for SGLang clients.
    return_text_in_logprobs: bool = False
    # With return_logprob: also score the prompt from this position (SGLang's name; -1: no).
    logprob_start_len: LogprobStart | list[LogprobStart] = -1
    rid: Name | list[Name] | None = None
    # vLLM's: only requests with the same salt share this prompt's cached KV.
    cache_salt: Name | None = None
    # Under --schedule-policy priority, lower values are admitted first (SGLang's, vLLM's).
    priority: Int = 0
    # A program session: the finished sequence stays cached for it until /close_session.
    session_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = None
    # How long the session keeps this request's KV after it (default: twice the longest pause
    # between the program's calls so far, 30 s before any; at most --session-ttl-s).
    session_ttl: SessionTTL | None = None
    # The call's position in its program (0 for its first call, then 1, ...), for the
    # scheduler's per-program accounting; needs session_id or program_id.
    session_position: ProgramPosition | None = None
    # The program run the request belongs to (default: its session's root, the part of
    # session_id before the first "."): a run without sessions names itself here, so the
    # program policies (--schedule-policy program, program-srpt) see one program, and ends
    # with POST /end_program.
    program_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = None
    # The same as session_id, session_ttl and session_position, SGLang's way:
    # {"id": ..., "ttl": ..., "position": ...}.
    session_params: SessionParams | None = None
    # Images (URL, data URL or base64; a list per prompt for a batch), one per image
    # placeholder in the text (`image_placeholder` of /get_model_info), in order.
    image_data: Text | list[Text] | list[list[Text]] | None = Field(
        None, union_mode="left_to_right"
    )
    # SGLang's, sent by its router: the served model's name; logging switches (braid logs
    # the same either way).
    model: Text | None = None
    log_metrics: bool = True
    no_logs: bool = False
    return_hidden_states: JsonValue = False
    background: JsonValue = False
    return_bytes: JsonValue = False
    return_entropy: JsonValue = False
    return_routed_experts: JsonValue = False
    INERT = {
        "return_routed_experts": ("braid serves no mixture-of-experts routing", (False,)),
        "return_hidden_states": ("braid returns no hidden states", (False,)),
        "background": ("requests are answered while the client waits", (False,)),
        "return_bytes": ("texts are returned as strings", (False,)),
        "return_entropy": ("token entropies are not returned", (False,)),
    }


class AbortRequest(_Body):
    rid: Annotated[Text, Field(min_length=1)]


class CloseSessionRequest(_Body):
    session_id: Annotated[Text, Field(min_length=1)]


class EndProgramRequest(_Body):
    program_id: Annotated[Text, Field(min_length=1, max_length=256)]


# SGLang's native sampling_params names -> braid's
NATIVE_SAMPLING_ALIASES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
}
# `bad_words_token_ids` is the engine's (made from `bad_words`), not a request's.
NATIVE_SAMPLING_FIELDS = (set(SamplingParams.__dataclass_fields__) - {"bad_words_token_ids"}) | set(
    NATIVE_SAMPLING_ALIASES
)


def native_sampling_params(raw: dict[str, Any], defaults: SamplingParams) -> SamplingParams:
    # A null is the default, as in the body; but a null max_new_tokens is SGLang's "up to the
    # context", which braid's None means too.
    raw = {k: v for k, v in raw.items() if v is not None or k in ("max_new_tokens", "max_tokens")}
    unknown = set(raw) - NATIVE_SAMPLING_FIELDS - {"spaces_between_special_tokens"}
    if unknown:
        raise ParamError.at("sampling_params", f"unknown field(s) {sorted(unknown)}")
    spaces = raw.get("spaces_between_special_tokens", True)
    if not isinstance(spaces, bool):  # as on the OpenAI routes: no effect either way
        raise ParamError.at("sampling_params.spaces_between_special_tokens", "must be a bool")
    fields = {
        NATIVE_SAMPLING_ALIASES.get(k, k): v
        for k, v in raw.items()
        if k != "spaces_between_special_tokens"
    }
    for alias, name in NATIVE_SAMPLING_ALIASES.items():
        if alias in raw and name in raw:
            raise ParamError.at(f"sampling_params.{alias}", f"give it or {name}, not both")
    # An error names the field as the body spells it (an alias by the alias).
    names = {name: alias for alias, name in NATIVE_SAMPLING_ALIASES.items() if alias in raw}
    if "logit_bias" in fields and isinstance(fields["logit_bias"], dict):
        try:
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        except ValueError:
            raise ParamError(
                "sampling_params.logit_bias", "sampling_params.logit_bias keys must be token ids"
            ) from None
    try:
        return defaults.replace(**fields)
    except ParamError as e:
        raise renamed(e, names) from None
