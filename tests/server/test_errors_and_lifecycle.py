"""Bad requests get OpenAI-style 4xx errors and the server keeps serving; auth; a dead child
process takes the server down with a message; SIGTERM leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from braid.runtime.ipc import codec
from braid.runtime.ipc.to_detokenizer import (
    BatchTokenOut,
    DetokSpec,
    Refusal,
    TokenLogprob,
    TokenOut,
)
from braid.runtime.ipc.to_scheduler import (
    AbortReq,
    ControlReq,
    GenerateBatch,
    GenerateReq,
    ShutdownReq,
)
from braid.runtime.ipc.to_tokenizer import (
    BatchStrOut,
    ControlOut,
    ProcessFailed,
    ProgramInfo,
    SchedulerHeartbeat,
    SchedulerReady,
    StrOut,
)
from braid.runtime.sampling_params import SamplingParams
from tests.server.conftest import sse_data, start_server, wait_idle

C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"
IMG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
MSG = [{"role": "user", "content": "hi"}]

BAD = [
    (C, b"{not json", 400, "not valid JSON"),
    (C, {}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "frequency_penalty": 5}, 400, "frequency_penalty"),
    (C, {"prompt": "x", "presence_penalty": -3}, 400, "presence_penalty"),
    (C, {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (C, {"prompt": [1, 2, 10**9]}, 400, "vocabulary"),
    (C, {"prompt": "word " * 9000}, 400, "context length"),
    (C, {"prompt": "x", "seed": "abc"}, 400, "seed"),
    (C, {"prompt": "x", "stop_token_ids": [10**8]}, 400, "stop_token_ids"),
    (C, {"prompt": "x", "echo": True, "stream": True}, 400, "echo"),
    (C, {"prompt": "x", "regex": "(unclosed"}, 400, "regex"),
    (CH, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "schema"),
    (CH, {"messages": []}, 400, "messages"),
    (CH, {"messages": [{"content": "no role"}]}, 400, "role"),
    (CH, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CH, {"messages": MSG, "max_completion_tokens": -1}, 400, "max_completion_tokens must be"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "image_url"),
    # Images to this text-only model (issue 15).
    (
        CH,
        {"messages": [{"role": "user", "content": [IMG, {"type": "text", "text": "x"}]}]},
        400,
        "takes text only",
    ),
    (G, {"text": "x", "image_data": "aGVsbG8="}, 400, "takes text only"),
    (G, {"sampling_params": {"max_new_tokens": 2}}, 400, "text"),
    (G, {"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens must be"),
    (G, {"text": "x", "sampling_params": {"stop_regex": "("}}, 400, "stop_regex"),
    (CH, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (G, {"text": "x", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    # Issue 13: what a hostile probe found.
    (CH, {"messages": MSG, "chat_template": "{{ 'x' * 50000000 }}"}, 400, "chat_template"),
    (C, {"prompt": "x", "max_tokens": 10**20}, 400, "max_tokens"),
    (G, {"text": "x", "sampling_params": {"max_new_tokens": 10**20}}, 400, "64 bits"),
    (C, {"prompt": "x", "n": 10000}, 400, "--max-samples-per-request"),
    (C, {"prompt": ["a"] * 129}, 400, "--max-samples-per-request"),
    (C, {"prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "x", "suffix": "y"}, 400, "suffix: not supported"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CH, {"messages": MSG, "stream_options": {}}, 400, "only with stream: true"),
    (CH, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400, "sets this"),
    (CH, {"messages": MSG, "chat_template_kwargs": {"tools": []}}, 400, "request's tools field"),
    (CH, {"messages": MSG, "chat_template_kwargs": 5}, 400, "chat_template_kwargs"),
    # vLLM's fields braid does not implement: refused by name, not dropped.
    (CH, {"messages": MSG, "length_penalty": 2.0}, 400, "length_penalty: only with use_beam"),
    (C, {"prompt": "x", "length_penalty": 2.0}, 400, "length_penalty: only with use_beam"),
    (C, {"prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs: not supported"),
    (CH, {"messages": MSG, "logits_processors": ["x"]}, 400, "logits_processors"),
    (CH, {"messages": MSG, "echo": True}, 400, "echo: not supported on chat"),
    (CH, {"messages": MSG, "modalities": ["text", "audio"]}, 400, "modalities: braid answers"),
    (CH, {"messages": MSG, "audio": {"voice": "alloy", "format": "mp3"}}, 400, "audio: braid"),
    (CH, {"messages": MSG, "functions": [{"name": "f"}]}, 400, "functions: the legacy fields"),
    (CH, {"messages": MSG, "function_call": "auto"}, 400, "function_call: the legacy fields"),
    (CH, {"messages": MSG, "web_search_options": {}}, 400, "web_search_options"),
    (
        CH,
        {"messages": MSG, "continue_final_message": True},
        400,
        "continue_final_message: not with add_generation_prompt",
    ),
    (C, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (C, {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    (G, {"text": "x", "cache_salt": 5}, 400, "cache_salt"),
    # A priority needs --schedule-policy priority (this server runs lpm).
    (C, {"prompt": "x", "priority": 1}, 400, "priority: needs the priority schedule policy"),
    (CH, {"messages": MSG, "priority": -2}, 400, "priority: needs the priority schedule"),
    (G, {"text": "x", "priority": 3}, 400, "priority: needs the priority schedule policy"),
    (C, {"prompt": "x", "priority": "high"}, 400, "priority"),
    (C, {"prompt": "x", "allowed_token_ids": [10**8]}, 400, "outside the vocabulary"),
    (C, {"prompt": "x", "bad_words": [""]}, 400, "bad_words"),
    (C, {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    (C, {"prompt": "x", "truncate_prompt_tokens": 10**6}, 400, "is greater than the context"),
    (C, {"prompt": "x", "truncate_prompt_tokens": 1, "echo": True}, 400, "echo: not with"),
    (G, {"text": "x", "sampling_params": {"bad_words_token_ids": [[1]]}}, 400, "unknown field"),
    ("/tokenize", {"prompt": "x", "messages": MSG}, 400, "exactly one of prompt and messages"),
    ("/tokenize", {}, 400, "exactly one of prompt and messages"),
    ("/detokenize", {"tokens": [1, 10**8]}, 400, "tokens[1]: 100000000 is outside"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    (
        "/tokenize",
        {"messages": MSG, "chat_template_kwargs": {"tokenize": True}},
        400,
        "chat_template_kwargs.tokenize",
    ),
    ("/tokenize", {"messages": MSG, "continue_final_message": True}, 400, "not with add_gen"),
    # SGLang's per-prompt lists in a /generate batch: one entry per prompt.
    (G, {"text": ["a", "b"], "sampling_params": [{}]}, 400, "a list of 1 for 2 prompt(s)"),
    (G, {"text": ["a", "b"], "rid": ["r", "r"]}, 400, "rid[1]: 'r' is given twice"),
    (G, {"text": ["a", "b"], "rid": ["r"]}, 400, "rid: a list of 1"),
    (G, {"text": ["a", "b"], "return_logprob": [True]}, 400, "return_logprob: a list of 1"),
    (G, {"text": "a", "top_logprobs_num": [1, 2]}, 400, "top_logprobs_num: a list of 2"),
    (
        G,
        {"text": ["a", "b"], "sampling_params": [{}, {"max_new_tokens": -1}]},
        400,
        "sampling_params[1]: max_new_tokens must be",
    ),
    (G, {"text": ["a", "b"], "sampling_params": [{}, {"bogus": 1}]}, 400, "sampling_params[1]: "),
    (
        G,
        {"text": ["a", "b"], "sampling_params": [{"n": 100}, {"n": 29}]},
        400,
        "129 samples over 2 prompts",
    ),
    (C, b'{"prompt": "\\ud800"}', 400, "surrogate"),
    (C, b'{"prompt": "x", "stop": ["\\udfff"]}', 400, "stop"),
    (CH, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "surrogate"),
    ("/tokenize", b'{"prompt": "a\\ud800"}', 400, "surrogate"),
    (C, b'{"prompt": "\xff\xfe\xfa"}', 400, "UTF-8"),
    (C, b"[" * 100000 + b"]" * 100000, 400, "nested too deeply"),
    (C, b"[1, 2]", 400, "JSON object"),
    ("/close_session", {"session_id": ""}, 400, "session_id"),
    ("/end_program", {"program_id": ""}, 400, "program_id"),
    ("/end_program", {}, 400, "program_id"),
    (G, {"text": "x", "program_id": ""}, 400, "program_id"),
    (G, {"text": "x", "program_id": 7}, 400, "program_id"),
    (G, {"text": "x", "session_ttl": 5}, 400, "session_ttl needs a session_id"),
    (G, {"text": "x", "session_id": "s", "session_ttl": 0}, 400, "session_ttl"),
    (G, {"text": "x", "session_params": {"id": "s", "rid": "r"}}, 400, "session_params.rid"),
    (G, {"text": "x", "session_id": "s", "session_params": {"id": "s"}}, 400, "not both"),
    (G, {"text": "x", "session_position": 0}, 400, "needs a session_id or a program_id"),
    (G, {"text": "x", "session_id": "s", "session_position": -1}, 400, "session_position"),
    (G, {"text": "x", "session_id": "s", "session_position": True}, 400, "session_position"),
    (G, {"text": "x", "session_params": {"id": "s", "position": 1.5}}, 400, "position"),
    (
        G,
        {"text": "x", "session_params": {"id": "s"}, "session_position": 1},
        400,
        "session_params or session_position",
    ),
    ("/no/such/route", {}, 404, "no route"),
    (C, {"prompt": "x", "regex": "(a)\\1"}, 400, "regex"),
    (C, {"prompt": "x", "stream": True, "regex": "(a)\\1"}, 400, "regex"),
    # Closed bodies: an unknown field is refused by name on every route, as OpenAI's API does.
    (C, {"prompt": "x", "lora_path": "a"}, 400, "Unrecognized request argument supplied: lora_"),
    (CH, {"messages": MSG, "include_reasoning": False}, 400, "argument supplied: include_reas"),
    (G, {"text": "x", "input_embeds": [[0.5]]}, 400, "argument supplied: input_embeds"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, 400, "add_special_tokens: Input"),
    ("/tokenize", {"prompt": "x", "return_token_ids": True}, 400, "supplied: return_token_ids"),
    ("/v1/responses", {"input": "x", "foo": 1}, 400, "Unrecognized request argument supplied: foo"),
    ("/v1/embeddings", {"input": "x", "priority": 1}, 400, "argument supplied: priority"),
    (
        CH,
        {"messages": MSG, "response_format": {"type": "json_object", "x": 1}},
        400,
        "argument supplied: response_format.x",
    ),
    # OpenAI's fields asking for what braid does not do, and the router's at other values.
    (CH, {"messages": MSG, "store": True}, 400, "store: not supported (braid keeps no"),
    (CH, {"messages": MSG, "service_tier": "flex"}, 400, "service_tier: not supported"),
    (CH, {"messages": MSG, "prompt_cache_retention": "24h"}, 400, "prompt_cache_retention"),
    (CH, {"messages": MSG, "verbosity": "low"}, 400, "verbosity: not supported"),
    (CH, {"messages": MSG, "prediction": {"type": "content", "content": "x"}}, 400, "prediction"),
    (CH, {"messages": MSG, "moderation": {"model": "m"}}, 400, "moderation: not supported"),
    (CH, {"messages": MSG, "reasoning_effort": "low"}, 400, "template does not read it"),
    (CH, {"messages": MSG, "stream_reasoning": False}, 400, "stream_reasoning: not supported"),
    (C, {"prompt": "x", "return_hidden_states": True}, 400, "return_hidden_states: not supp"),
    (
        CH,
        {"messages": MSG, "stream": True, "stream_options": {"include_obfuscation": True}},
        400,
        "include_obfuscation: not supported",
    ),
    (G, {"text": "x", "return_entropy": True}, 400, "return_entropy: not supported"),
    (G, {"text": "x", "background": True}, 400, "background: not supported"),
    (G, {"text": "x", "sampling_params": {"seed": 1, "sampling_seed": 2}}, 400, "not both"),
    (G, {"text": "x", "sampling_params": {"spaces_between_special_tokens": 1}}, 400, "a bool"),
    ("/v1/responses", {"input": "x", "context_management": [{}]}, 400, "context_management"),
    ("/v1/responses", {"input": "x", "prompt_cache_retention": "24h"}, 400, "prompt_cache_ret"),
    ("/tokenize", {"prompt": "x", "tools": [{"type": "function"}]}, 400, "only with messages"),
    ("/tokenize", {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    (CH, {"messages": [{"role": "user"}]}, 400, "messages[0].content: required for a user"),
    (CH, {"messages": MSG + [{"role": "assistant", "tool_calls": [{}]}]}, 400, "function.name"),
    (CH, {"messages": MSG, "chat_template": ""}, 400, "chat_template: Value should have at least"),
    (
        CH,
        {
            "messages": MSG,
            "tool_choice": "none",
            "tools": [{"function": {"name": "f", "strict": "yes"}}],
        },
        400,
        "tools[0].function.strict: must be true or false",
    ),
    # Errors name the field as the body spells it.
    (G, {"text": "x", "sampling_params": {"sampling_seed": 1.5}}, 400, "sampling_seed must be"),
    (G, {"text": "x", "return_logprob": True, "top_logprobs_num": 50}, 400, "top_logprobs_num"),
    (G, {"text": "x", "return_logprob": True, "logprob_start_len": -5}, 400, "logprob_start_len"),
    # The default server's template shows no call format: "auto" tool calls are refused.
    (
        CH,
        {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        'tool_choice: "auto" (the default with tools) needs a tool-call parser',
    ),
    (G, {"text": "x", "sampling_params": {"regex": "(a)\\1"}}, 400, "regex"),
    # The part of a session id before its first "." names its program: not empty.
    (G, {"text": "x", "session_id": ".a"}, 400, "session_id '.a' begins with '.'"),
    # More new tokens than the context leaves room for: refused, as vLLM's server and SGLang
    # do (a client's max_tokens is not cut short silently with finish_reason "length").
    (C, {"prompt": "x", "max_tokens": 9000}, 400, "max_tokens: 9000 is too large: the context"),
    (CH, {"messages": MSG, "max_tokens": 9000}, 400, "max_tokens: 9000 is too large"),
    (CH, {"messages": MSG, "max_completion_tokens": 9000}, 400, "max_completion_tokens: 9000"),
    (G, {"text": "x", "sampling_params": {"max_new_tokens": 9000}}, 400, "max_new_tokens: 9000"),
    (
        G,
        {"text": ["x", "y"], "sampling_params": [{}, {"max_tokens": 9000}]},
        400,
        "sampling_params[1].max_tokens: 9000 is too large",
    ),
    (C, {"prompt": "x", "n": 2, "max_tokens": 9000, "use_beam_search": True}, 400, "too large"),
    # logprobs 0 asks for the chosen tokens' logprobs, which beams do not give (0 == False).
    (C, {"prompt": "x", "n": 2, "use_beam_search": True, "logprobs": 0}, 400, "logprobs: not"),
    (CH, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens: must be"),
    (
        C,
        b'{"prompt": "x", "n": 2, "use_beam_search": true, "length_penalty": Infinity}',
        400,
        "length_penalty: must be a finite number",
    ),
    ("/v1/responses", {"input": "x", "max_output_tokens": 9000}, 400, "max_output_tokens: 9000"),
]


@pytest.mark.parametrize("path, body, status, needle", BAD)
def test_bad_requests_get_clear_4xx(server, path, body, status, needle):
    url = server.url + path
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert needle in err["message"], err


# (API, arguments, the param the error body names): each value refused where it is checked
# (pydantic, SamplingParams, the TokenizerManager, the scheduler's grammar compile across ZMQ)
# names its field as data, read here by the real openai client.
PARAMS = [
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"top_p": 2}, "top_p"),
    ("completions", {"max_tokens": 2**64}, "max_tokens"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("completions", {"prompt": "word " * 9000}, "prompt"),
    ("completions", {"prompt": [[1, 2], [1, 10**9]]}, "prompt[1]"),
    ("completions", {"extra_body": {"regex": "(a)\\1"}}, "regex"),
    ("completions", {"stream": True, "extra_body": {"regex": "(a)\\1"}}, "regex"),
    ("completions", {"extra_body": {"stop_regex": "("}}, "stop_regex"),
    ("chat", {"response_format": {"type": "bogus"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat", {"temperature": -1, "stream": True}, "temperature"),
    (
        "chat",
        {"extra_body": {"json_schema": {"type": "array", "uniqueItems": True}}},
        "json_schema",
    ),
    ("chat", {"extra_body": {"choice": []}}, "choice"),
    ("completions", {"suffix": "the end"}, "suffix"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"max_completion_tokens": -5}, "max_completion_tokens"),
    ("chat", {"max_completion_tokens": 9000}, "max_completion_tokens"),
    ("completions", {"max_tokens": 9000}, "max_tokens"),
    (
        "chat",
        {"extra_body": {"chat_template_kwargs": {"tokenize": True}}},
        "chat_template_kwargs.tokenize",
    ),
]


@pytest.mark.parametrize("api, kwargs, param", PARAMS)
def test_a_refused_value_names_its_param_for_the_openai_client(server, api, kwargs, param):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        if api == "chat":
            client.chat.completions.create(model="m", messages=MSG, max_tokens=2, **kwargs)
        else:
            client.completions.create(**{"model": "m", "prompt": "x", "max_tokens": 2, **kwargs})
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"


# What SGLang's router (sglang-router 0.3.2) adds to the bodies it forwards, as a worker
# behind it received them (measured in front of a worker that logged its bodies).
ROUTER_CHAT = {
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
ROUTER_GENERATE = {
    "model": None,
    "return_text_in_logprobs": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}


def test_what_openai_clients_and_routers_send_by_default_is_taken(server):
    """The inert values of the refused fields pass: text-only modalities, stream_options with
    stream, echo false, length_penalty 1, an empty suffix, OpenAI's hints that change nothing,
    and what SGLang's router adds to every body."""
    ok = [
        (CH, {"messages": MSG, "modalities": ["text"], "echo": False}),
        (C, {"prompt": "x", "suffix": "", "length_penalty": 1.0, "use_beam_search": False}),
        (C, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}),
        (
            CH,
            {
                "messages": MSG,
                "metadata": {"team": "a"},
                "store": False,
                "service_tier": "auto",
                "prompt_cache_key": "k",
                "prompt_cache_retention": "in_memory",
                "safety_identifier": "u1",
                "user": "u",
                "spaces_between_special_tokens": False,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "description": "d", "schema": {}},
                },
            },
        ),
        (CH, {"messages": MSG, **ROUTER_CHAT}),
        (C, {"prompt": "x", "no_stop_trim": False, "return_hidden_states": False}),
        (G, {"text": "x", **ROUTER_GENERATE}),
    ]
    for path, body in ok:
        limit = {"sampling_params": {"max_new_tokens": 2}} if path == G else {"max_tokens": 2}
        r = httpx.post(server.url + path, json={**body, **limit})
        assert r.status_code == 200, (path, r.text)


def test_null_means_not_given(server):
    """A null for a field with a default is that default, as OpenAI reads it: the openai client
    sends an explicit `None` as null."""
    nulls = dict.fromkeys(
        ["n", "presence_penalty", "frequency_penalty", "stream", "logprobs", "seed", "user"]
    )
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    c = client.chat.completions.create(
        model="m", messages=MSG, max_tokens=2, parallel_tool_calls=None, **nulls
    )
    assert len(c.choices) == 1 and c.usage.completion_tokens >= 1
    body = {"prompt": "x", "max_tokens": 2, "echo": None, "best_of": None, **nulls}
    r = httpx.post(server.url + C, json=body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = httpx.post(server.url + G, json={"text": "x", "stream": None, "sampling_params": None})
    assert r.status_code == 200, r.text
    # A null for a field braid does not know asks for nothing (SGLang's bench_serving sends
    # lora_path: null); a null in /generate's sampling_params is the default.
    sp = {"max_new_tokens": 2, "temperature": None, "n": None, "top_p": None}
    body = {"text": "x", "lora_path": None, "return_routed_experts": False, "sampling_params": sp}
    r = httpx.post(server.url + G, json=body)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text
    r = httpx.post(server.url + CH, json={"messages": None})  # required: null is not given
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_vllms_add_special_tokens_and_continuous_usage(server):
    """vLLM's `add_special_tokens` (completions, /tokenize): false tokenizes a prompt without
    the tokenizer's special tokens; `stream_options.continuous_usage_stats`: every chunk
    carries the usage so far."""
    tok = "/tokenize"
    with_bos = httpx.post(server.url + tok, json={"prompt": "Hello"}).json()["tokens"]
    bare = httpx.post(server.url + tok, json={"prompt": "Hello", "add_special_tokens": False})
    bare = bare.json()["tokens"]
    body = {"prompt": "Hello", "max_tokens": 1, "add_special_tokens": False}
    used = httpx.post(server.url + C, json=body).json()["usage"]["prompt_tokens"]
    assert used == len(bare) and with_bos[-len(bare) :] == bare
    stream = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "Count: 1, 2,", "max_tokens": 4, "stream": True, "stream_options": stream}
    chunks = [json.loads(d) for d in sse_data(server.url + C, body)]
    chunks = [c for c in chunks if c["choices"]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and all(c["usage"] for c in chunks)


def test_no_stop_trim_keeps_the_stop_string(server):
    """SGLang's `no_stop_trim` (on the OpenAI routes and in /generate's sampling_params) is
    `include_stop_str_in_output`: the stop string stays in the text."""
    body = {"prompt": "Count: 1, 2, 3, 4, 5, 6,", "max_tokens": 12, "temperature": 0}
    plain = httpx.post(server.url + C, json={**body, "stop": [","]}).json()
    stop = plain["choices"][0]["text"]
    assert plain["choices"][0]["finish_reason"] == "stop" and "," not in stop
    kept = httpx.post(server.url + C, json={**body, "stop": [","], "no_stop_trim": True}).json()
    assert kept["choices"][0]["text"] == stop + ","
    native = {"text": body["prompt"], "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    native["sampling_params"].update(stop=[","], no_stop_trim=True)
    assert httpx.post(server.url + G, json=native).json()["text"] == stop + ","


def test_server_still_serves_after_bad_requests(server):
    r = httpx.post(server.url + C, json={"prompt": "1 + 1 =", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    stats = wait_idle(server.url)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_capacity_tokens"]


def test_profile_endpoints_write_a_trace_of_named_forwards(server):
    """POST /start_profile and /stop_profile (SGLang's and vLLM's): the scheduler's torch
    profile of the requests in between, written under the server's profiler directory, each
    forward a named range; a second start and a stop without a start are 400s that say why."""
    import gzip
    import json

    assert httpx.post(server.url + "/stop_profile").status_code == 400
    r = httpx.post(server.url + "/start_profile")
    assert r.status_code == 200, r.text
    again = httpx.post(server.url + "/start_profile")
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    body = {"prompt": "1 + 1 =", "max_tokens": 4, "temperature": 0}
    assert httpx.post(server.url + C, json=body).status_code == 200
    r = httpx.post(server.url + "/stop_profile", timeout=120)
    assert r.status_code == 200, r.text
    written = sorted(server.profile_dir.iterdir())
    assert [p.name.split(".", 1)[1] for p in written] == ["trace.json.gz", "txt"]
    assert all(str(p) in r.text for p in written)
    trace = json.load(gzip.open(written[0]))
    names = [e.get("name") for e in trace["traceEvents"]]
    assert names.count("braid.prefill") == 1 and names.count("braid.decode") >= 3
    table = written[1].read_text()
    assert table.startswith(f"{names.count('braid.prefill') + names.count('braid.decode')} ")
    assert "braid.prefill" in table and "aten::" in table
    no_run = httpx.post(server.url + "/stop_profile")
    assert no_run.status_code == 400 and "no profile is running" in no_run.text
    assert httpx.post(server.url + C, json=body).status_code == 200  # still serving


def test_oversized_body_is_refused_then_sigterm_exits_0(tmp_path):
    key = tmp_path / "key"
    key.write_text("sekrit\n")
    s = start_server(tmp_path, "--max-request-bytes", "1000", "--api-key-file", str(key))
    try:
        h = {"Authorization": "Bearer sekrit"}
        r = httpx.post(s.url + C, json={"prompt": "x" * 2000}, headers=h)
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit is counted as the body arrives
            for _ in range(50):
                yield b" " * 100

        r = httpx.post(s.url + C, content=chunks(), headers=h)
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
        assert r.headers["connection"] == "close"  # the rest of the body is never parsed
        # The refused body is drained before the answer: the client gets the 413, not a reset
        # (the server closing on unread data made TCP reset the connection).
        big = b'{"prompt": "' + b"x" * 200_000 + b'"}'
        for _ in range(5):
            with httpx.Client(headers=h) as c:
                assert c.get(s.url + "/no/such/route").status_code == 404
                assert c.post(s.url + C, content=big).status_code == 413
        # API key: missing and wrong keys are 401, the right one works.
        assert httpx.post(s.url + C, json={"prompt": "x"}).status_code == 401
        wrong = httpx.post(s.url + C, json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401 and "invalid API key" in wrong.json()["error"]["message"]
        ok = httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 2}, headers=h)
        assert ok.status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # health needs no key
        metrics = httpx.get(s.url + "/metrics")  # nor /metrics (Prometheus scrapes it), as vLLM
        assert metrics.status_code == 200 and "braid_" in metrics.text
        assert httpx.get(s.url + "/get_server_info").status_code == 401
        pids = httpx.get(s.url + "/get_server_info", headers=h).json()["pids"]
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(15)
        assert s.proc.returncode == 0, s.log()
        assert "shut down cleanly" in s.log()
        time.sleep(0.5)
        assert not any(_alive(pids[n]) for n in ("scheduler", "detokenizer"))
    finally:
        s.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_scheduler_takes_the_server_down_with_a_message(tmp_path):
    s = start_server(tmp_path)
    pids = httpx.get(s.url + "/get_server_info").json()["pids"]
    os.kill(pids["scheduler"], signal.SIGKILL)
    t0 = time.time()
    s.proc.wait(10)
    assert time.time() - t0 < 10
    assert s.proc.returncode != 0
    assert "scheduler" in s.log() and "died" in s.log()
    assert "shut down cleanly" not in s.log() and "exited after a runtime failure" in s.log()
    deadline = time.time() + 5
    while _alive(pids["detokenizer"]) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pids["detokenizer"])


def test_a_hung_scheduler_fails_its_requests_and_the_server_at_the_watchdog_timeout(tmp_path):
    """A scheduler that stops answering (SIGSTOP: a hang) left its requests waiting for ever
    while /health said 503. Past --watchdog-timeout they end with an error naming it and the
    server exits 1 for its supervisor, leaving no process behind. Started on --port 0: the
    ready line names the port the system chose."""
    import subprocess
    import sys

    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "braid", "serve", "--port", "0", "--watchdog-timeout", "3"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.time() + 180
        while not (ready := re.search(r"ready at http://127\.0\.0\.1:(\d+)", log_path.read_text())):
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()
            time.sleep(0.2)
        url = f"http://127.0.0.1:{int(ready.group(1))}"
        assert int(ready.group(1)) != 0 and httpx.get(url + "/health").status_code == 200
        pids = httpx.get(url + "/get_server_info").json()["pids"]
        os.kill(pids["scheduler"], signal.SIGSTOP)
        t0 = time.time()
        r = httpx.post(
            url + "/generate",
            json={"text": "Hi", "sampling_params": {"max_new_tokens": 8}},
            timeout=60,
        )
        waited = time.time() - t0
        assert 2 < waited < 20, waited
        reason = r.json()["meta_info"]["finish_reason"]  # a started request ends as aborted
        assert reason["type"] == "abort" and "watchdog timeout (3 s)" in reason["message"]
        proc.wait(30)
        assert proc.returncode == 1, log_path.read_text()
        assert "the scheduler has not reported for" in log_path.read_text()
        time.sleep(0.5)
        assert not any(_alive(pids[n]) for n in ("scheduler", "detokenizer"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


LP = TokenLogprob(5, -0.5, 1, [(5, -0.5), (7, -1.5)])
MESSAGES = [
    GenerateReq("r1", [1, 2, 3], SamplingParams(stop=["x"], logit_bias={4: 1.0}, seed=3), 99),
    AbortReq("r1"),
    ControlReq(7, "stats"),
    ShutdownReq(),
    BatchTokenOut(
        [
            TokenOut(
                "r1",
                [5],
                3,
                1,
                None,
                None,
                None,
                [LP],
                [None, LP],
                DetokSpec([1], True, ["x"], False, 0),
            )
        ]
    ),
    BatchTokenOut([TokenOut("r2", [], 3, 0, "abort", error="regex: no", refused=Refusal("regex"))]),
    BatchStrOut([StrOut("r1", "hi", [5], 3, 1, 0, "stop", "x", None, [LP], None, {5: "hi"})]),
    BatchStrOut([StrOut("r2", "", [], 3, 0, 0, "abort", error="x", refused=Refusal(None))]),
    ControlOut(7, True, {"a": 1.0}, None),
    ControlOut(7, True, {}, None, [ProgramInfo("p", 1, 3, 2, 2, 40, 16, 1)]),
    SchedulerReady(100, 200, 8, 512, [2], "cpu", "float32", 1.5),
    ProcessFailed("scheduler", "boom"),
    SchedulerHeartbeat({"running_requests": 1.0}, 0.25),
    SchedulerHeartbeat({}, 0.5, [ProgramInfo("q", 0, 1, 1, None, 8, 0, 0)]),
    GenerateReq("r2", [1], SamplingParams(), 1, "s.0", program_position=4),
    GenerateBatch(
        [
            GenerateReq("r3", [1], SamplingParams(), 1),
            GenerateReq("r4", [2, 3], SamplingParams(n=2), 5),
        ]
    ),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_codec_round_trip(msg):
    assert codec.decode(codec.encode(msg)) == msg


def test_codec_rejects_unknown_and_malformed():
    with pytest.raises(TypeError):
        codec.encode(object())
    with pytest.raises(ValueError):
        codec.decode([b"\xff\xff", b"\x80"])
    with pytest.raises(Exception):  # noqa: B017 - msgspec's ValidationError or DecodeError
        codec.decode([(1).to_bytes(2, "little"), b"\x93\x01\x02\x03"])
    with pytest.raises(ValueError, match="exactly two frames"):  # only a batch has more
        codec.decode([*codec.encode(AbortReq("a")), b""])
    with pytest.raises(Exception):  # noqa: B017 - a batch's every body is a GenerateReq
        codec.decode(
            [*codec.encode(GenerateBatch([MESSAGES[0]]))[:2], codec.encode(AbortReq("a"))[1]]
        )


def test_children_die_with_a_killed_server(tmp_path):
    s = start_server(tmp_path)
    pids = httpx.get(s.url + "/get_server_info").json()["pids"]
    s.proc.kill()  # SIGKILL: no chance to clean up
    s.proc.wait(5)
    deadline = time.time() + 10
    while any(_alive(pids[n]) for n in ("scheduler", "detokenizer")) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pids[n]) for n in ("scheduler", "detokenizer"))


def test_the_api_key_comes_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    from braid.runtime.server.cli import _api_key, build_parser

    def key(*flags: str) -> str | None:
        return _api_key(build_parser().parse_args(["serve", *flags]))

    monkeypatch.delenv("BRAID_API_KEY", raising=False)
    assert key() is None
    monkeypatch.setenv("BRAID_API_KEY", "from-env")
    assert key() == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert key("--api-key-file", str(f)) == "from-file"
    assert key("--api-key", "from-flag", "--api-key-file", str(f)) == "from-flag"
    f.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        key("--api-key-file", str(f))


def test_a_refused_priority_is_not_counted_as_a_request(server):
    """A priority under lpm is a 400 before the request is counted (or its images made), and
    so is a rid in flight."""

    def received() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(re.search(r"^braid_requests_total (\S+)$", text, re.M).group(1))

    before = received()
    for path, body in [
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": 1}),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 1, "priority": 1}),
        ("/generate", {"text": "x", "priority": 1}),
        ("/v1/responses", {"input": "x", "max_output_tokens": 1, "priority": 1}),
    ]:
        assert httpx.post(server.url + path, json=body).status_code == 400
    assert received() == before
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 200 and received() == before + 1
    # A rid already in flight is refused when submitted: not counted either.
    busy = {"text": "Count:", "rid": "busy-rid"}
    busy["sampling_params"] = {"max_new_tokens": 2000, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, f"{server.url}/generate", json=busy, timeout=120)
        deadline = time.monotonic() + 30
        while not httpx.get(f"{server.url}/get_server_info").json()["stats"]["running_requests"]:
            assert time.monotonic() < deadline, "the first request never ran"
            time.sleep(0.05)
        again = httpx.post(f"{server.url}/generate", json=busy)
        assert again.status_code == 400 and "already in use" in again.text, again.text
        assert received() == before + 2  # the first only
        httpx.post(f"{server.url}/abort_request", json={"rid": "busy-rid"})
        assert first.result().status_code == 200
