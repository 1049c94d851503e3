"""The typed response bodies and the fast encoders beside them agree: a stream chunk as
`ChunkEncoder` writes it (its head encoded once from the chunk model, its choices as plain
data) parses into the chunk model, as do the deltas the chat stream's parsers produce; a whole
body as `encode_listed` writes it is the model's own JSON; fields that do not apply are left
out, fields that apply but are empty are null."""

from __future__ import annotations

import orjson
import pydantic
import pytest

from braid.runtime.function_call.base import ContentDelta, ToolCallDelta
from braid.runtime.server.guard import error_body
from braid.runtime.server.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChunk,
    ErrorResponse,
    PromptTokensDetails,
    Usage,
)
from braid.runtime.server.outputs import ChunkEncoder, encode_listed
from braid.runtime.server.serving_chat import ReasoningTextDelta

USAGE = Usage(
    prompt_tokens=3,
    completion_tokens=2,
    total_tokens=5,
    prompt_tokens_details=PromptTokensDetails(cached_tokens=1),
)
LOGPROBS = {
    "content": [
        {
            "token": "hi",
            "logprob": -0.5,
            "bytes": [104, 105],
            "top_logprobs": [{"token": "hi", "logprob": -0.5, "bytes": [104, 105]}],
        }
    ]
}


def _payload(event: bytes) -> bytes:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n"), event
    return event[6:-2]


@pytest.mark.parametrize("include_usage", [False, True])
def test_encoded_chat_chunks_parse_into_the_chunk_model(include_usage):
    head = ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[])
    enc = ChunkEncoder(head, include_usage)
    opening = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    token = {"index": 0, "logprobs": LOGPROBS, "finish_reason": None, "delta": {"content": "hi"}}
    last = {
        "index": 0,
        "logprobs": None,
        "finish_reason": "abort",
        "error": {"message": "boom", "type": "server_error"},
        "delta": {},
    }
    for choices in ([opening], [token], [last]):
        chunk = ChatCompletionChunk.model_validate_json(_payload(enc.chunk(choices)))
        assert (chunk.id, chunk.object, chunk.created, chunk.model) == (
            "chatcmpl-1",
            "chat.completion.chunk",
            7,
            "m",
        )
        assert chunk.choices[0].model_dump(exclude_unset=True) == choices[0]
        raw = orjson.loads(_payload(enc.chunk(choices)))
        assert ("usage" in raw) == include_usage and raw.get("usage") is None
    if include_usage:
        final = ChatCompletionChunk.model_validate_json(_payload(enc.chunk([], USAGE)))
        assert final.choices == [] and final.usage == USAGE


def test_encoded_completion_chunks_parse_into_the_chunk_model():
    head = CompletionChunk(id="cmpl-1", created=7, model="m", choices=[])
    enc = ChunkEncoder(head, include_usage=True)
    logprobs = {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [{"a": -1.0}]}
    item = {
        "index": 1,
        "logprobs": {**logprobs, "text_offset": [0]},
        "finish_reason": "length",
        "text": "a",
    }
    chunk = CompletionChunk.model_validate_json(_payload(enc.chunk([item])))
    assert chunk.object == "text_completion" and chunk.choices[0].text == "a"
    assert chunk.usage is None and "usage" in chunk.model_fields_set


def test_a_key_the_chunk_model_lacks_fails_to_parse():
    # What keeps the encoder and the model from drifting apart: a chunk with a field the
    # model does not declare does not parse.
    enc = ChunkEncoder(ChatCompletionChunk(id="c", created=1, model="m", choices=[]), False)
    item = {"index": 0, "logprobs": None, "finish_reason": None, "delta": {}, "extra": 1}
    with pytest.raises(pydantic.ValidationError, match="extra"):
        ChatCompletionChunk.model_validate_json(_payload(enc.chunk([item])))


def test_the_chat_streams_deltas_are_chat_deltas():
    deltas = [
        ContentDelta("text"),
        ToolCallDelta(0, id="call_1", name="get_weather"),
        ToolCallDelta(0, arguments='{"city": "Rome"}'),
        ReasoningTextDelta("thinking"),
    ]
    for d in deltas:
        wire = d.to_openai()
        assert ChatDelta.model_validate(wire).model_dump() == wire


def test_a_whole_body_encodes_as_the_models_json_with_what_does_not_apply_left_out():
    plain = AssistantMessage(content="hi")
    thinking = AssistantMessage(content="hi", reasoning_content=None, reasoning=None)
    body = ChatCompletion(
        id="chatcmpl-1",
        created=7,
        model="m",
        choices=[
            ChatChoice(index=0, message=plain, finish_reason="stop", logprobs=LOGPROBS),
            ChatChoice(
                index=1, message=thinking, finish_reason="stop", logprobs=None, stop_reason="x"
            ),
        ],
        usage=USAGE,
    )
    raw = orjson.loads(encode_listed(body, "choices"))
    assert raw == orjson.loads(body.model_dump_json())
    first, second = raw["choices"]
    assert first["message"] == {"role": "assistant", "content": "hi"}
    assert "stop_reason" not in first and "error" not in first
    assert second["message"]["reasoning_content"] is None and second["stop_reason"] == "x"
    assert "completion_tokens_details" not in raw["usage"]
    assert ChatCompletion.model_validate(raw) == body


def test_the_error_body_is_openais_shape_with_its_param():
    body = ErrorResponse.model_validate_json(error_body(400, "top_p: bad", "top_p"))
    assert body.error.model_dump() == {
        "message": "top_p: bad",
        "type": "invalid_request_error",
        "param": "top_p",
        "code": 400,
    }
