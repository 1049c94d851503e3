"""OpenAI's chat completions: `POST /v1/chat/completions`, with the server's chat template (or,
where the operator allows it, the request's own, rendered in the sandbox process), tools, and
with `--reasoning-parser` the model's thinking split out as `reasoning_content`."""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from braid.runtime.errors import ParamError
from braid.runtime.function_call.base import ContentDelta, ToolCall, ToolCallStream
from braid.runtime.function_call.tools import ToolPlan, finish_reason
from braid.runtime.ipc.to_scheduler import ImageInput
from braid.runtime.ipc.to_tokenizer import StrOut
from braid.runtime.reasoning.base import ReasoningDelta, ReasoningParser
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.server.guard import APIError
from braid.runtime.server.inputs import check_model, json_body, validate_prompts
from braid.runtime.server.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
)
from braid.runtime.server.openapi import answers, takes
from braid.runtime.server.outputs import Choice, finish_of, text_of
from braid.runtime.server.protocol import ChatCompletionRequest
from braid.runtime.server.serving_beam import beam_params, beam_response
from braid.runtime.server.serving_openai import OpenAIResponse
from braid.runtime.server.state import ServerState
from braid.runtime.tokenizer.chat import ChatPrompt, chat_prompt, template_messages
from braid.runtime.tokenizer.tokenizer import check_template_kwargs, template_reads


def prepare_chat(state: ServerState, req: ChatCompletionRequest, text: str | None):
    """The prompt text, its ids, its image sources, the sampling params and the tool plan of
    a chat request (blocking: run it on a worker thread); `text` is the prompt when a
    request's own template rendered it already."""
    plan = _tool_plan(state, req)
    if (
        plan is not None
        and plan.mode == "auto"
        and plan.parser is None
        and not state.raw_tool_calls
    ):
        # No call could be read from the text: the tools would change nothing (vLLM refuses
        # this too).
        raise APIError(
            400,
            'tool_choice: "auto" (the default with tools) needs a tool-call parser and this '
            "server has none (start it with --tool-call-parser); use tool_choice 'required' "
            "or a named function",
            "tool_choice",
        )
    prompt = _chat_prompt(state, req, plan, text)
    text, ids, sources = prompt.text, prompt.ids, prompt.sources
    state.media.check_count(len(sources), "messages")
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    if max_tokens is None:
        max_tokens = state.chat_max_tokens  # None: up to the context
    field = _max_tokens_field(req)
    if max_tokens == 0:
        raise APIError(400, f"{field}: must be >= 1", field)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    names = {"logprobs": "top_logprobs", "max_tokens": field}
    params = req.sampling_params(
        state.defaults, max_tokens=max_tokens, logprobs=logprobs, names=names, open_ended=True
    )
    if plan is not None:
        params = plan.sampling_params(params)  # a ParamError names the field
    params = state.tm.resolve(params)  # bad words tokenized once, here off the event loop
    if not sources:
        state.media.check_no_placeholders(ids, "messages")
        ((text, ids),) = validate_prompts(
            state, [(text, ids)], params, "messages", max_tokens_field=_given_max_tokens(req)
        )
    return text, ids, sources, params, plan


def _max_tokens_field(req: ChatCompletionRequest) -> str:
    """The field that gives the request's most tokens to generate, as the body spells it."""
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


def _given_max_tokens(req: ChatCompletionRequest) -> str | None:
    """`_max_tokens_field` where the body gives one, else None (a default, which the context
    cuts short)."""
    given = req.max_completion_tokens is not None or req.max_tokens is not None
    return _max_tokens_field(req) if given else None


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(
        "/v1/chat/completions",
        openapi_extra=takes(ChatCompletionRequest),
        responses=answers(ChatCompletion, streamed=True),
    )
    async def chat(
        request: Request, req: Annotated[ChatCompletionRequest, json_body(ChatCompletionRequest)]
    ):
        check_model(state, req.model)
        if not req.messages:
            raise APIError(400, "messages: must not be empty", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", "top_logprobs")
        try:
            req.refuse_unserved()
        except ParamError as e:
            raise APIError.refused(e) from None
        check_template_fields(req)
        if not req.use_beam_search and req.length_penalty != 1:
            raise APIError(400, "length_penalty: only with use_beam_search", "length_penalty")
        text = None
        if req.chat_template is not None:
            text = await render_request_template(req)
        try:
            response = await build_chat(state, req, text)
            if req.use_beam_search:
                return await _beam_search(state, req, response, request)
            return await response.respond(request)
        except APIError as e:
            raise in_tools_terms(e, req) from None

    async def render_request_template(req: ChatCompletionRequest) -> str:
        sandbox = state.template_sandbox
        if not state.allow_request_chat_template or sandbox is None:
            raise APIError(
                400,
                "chat_template: this server does not take a chat template from requests "
                "(the operator can allow it with --allow-request-chat-template)",
                "chat_template",
            )
        plan = await asyncio.to_thread(_tool_plan, state, req)
        messages = await asyncio.to_thread(_template_messages, state, req)
        kwargs = await asyncio.to_thread(template_kwargs, state, req)
        return await asyncio.get_running_loop().run_in_executor(
            sandbox.executor,
            functools.partial(
                sandbox.render,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                chat_template=req.chat_template,
                tools=plan.template_tools if plan else None,
                template_kwargs=kwargs,
                continue_final_message=req.continue_final_message,
                documents=req.documents,
            ),
        )


class ChatResponse(OpenAIResponse):
    """A chat completion; with a reasoning parser, each output's thinking becomes its
    reasoning and the rest its content; with a tool plan, that content becomes content and
    tool calls."""

    body_model = ChatCompletion
    chunk_model = ChatCompletionChunk
    id_prefix = "chatcmpl"

    def __init__(
        self,
        state: ServerState,
        req: ChatCompletionRequest,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        plan: ToolPlan | None,
        images: list[list[ImageInput]] | None = None,
        reasoning: type[ReasoningParser] | None = None,
    ) -> None:
        super().__init__(state, req, prompts, params, images)
        self.plan = plan
        self.reasoning = reasoning

    def grammar_waits(self) -> list[tuple[list[int], int | None]] | None:
        """Per prompt, what its constraint waits for (`GenerateReq.grammar_after` and
        `grammar_open`). With a reasoning parser a constraint applies to the answer, not to
        the thinking: after the end marker when the prompt opened the thinking; when the model
        may or may not open it (Qwen3), after the end marker only if the first token opens it
        (a one-token opening marker; a longer one cannot be decided on one token, and the
        constraint then applies from the start). It applies from the start when the prompt
        has already closed the thinking (a template with thinking turned off) or when the
        constraint itself spells the end marker (it then covers the thinking too)."""
        cls, constraint = self.reasoning, self.params.constraint
        if cls is None or constraint is None or cls.end in str(constraint[1]):
            return None
        tok = self.state.tokenizer
        end, start = cls.end_token_ids(tok), cls.start_token_ids(tok)
        waits: list[tuple[list[int], int | None]] = []
        for text, _ in self.prompts:
            text = text or ""
            if _thinking_closed(text, cls):
                waits.append(([], None))
            elif cls.starts_in_reasoning(text):
                waits.append((end, None))
            elif len(start) == 1:
                waits.append((end, start[0]))
            else:
                waits.append(([], None))
        return waits

    def _reasoning_parser(self, i: int) -> ReasoningParser | None:
        """A fresh reasoning parser for choice `i` (it reads the choice's prompt), if any."""
        if self.reasoning is None:
            return None
        return self.reasoning(self.prompts[self.prompt_of[i]][0])

    def logprobs(self, c: Choice, offset: int) -> dict[str, Any]:
        return _chat_logprobs(self.state, c, self.params.logprobs or 0)

    def choice(self, i: int, c: Choice, common: dict[str, Any]) -> ChatChoice:
        common["message"], common["finish_reason"] = _chat_message(
            c, self.plan, self._reasoning_parser(i)
        )
        return ChatChoice(**common)

    def delta(self, item: dict[str, Any], out: StrOut) -> None:
        item["delta"] = {"content": out.text} if out.text else {}

    def opening(self) -> list[dict[str, Any]] | None:
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(len(self.choices))
        ]

    def tool_streams(self) -> list[ToolCallStream] | None:
        parsers = [self.plan.stream() for _ in self.choices] if self.plan is not None else []
        if self.reasoning is not None:
            return [
                SeparatedStream(self._reasoning_parser(i), parsers[i] if parsers else None)
                for i in range(len(self.choices))
            ]
        return parsers if parsers and parsers[0] else None  # type: ignore[return-value]


async def build_chat(
    state: ServerState,
    req: ChatCompletionRequest,
    text: str | None = None,
) -> ChatResponse:
    """A chat request made ready to run: rendered (unless `text` is given), tokenized, its
    images processed and every limit checked; an `APIError` names what is wrong. Other APIs
    (`serving_responses`) run their requests through it too."""
    text, ids, sources, params, plan = await asyncio.to_thread(prepare_chat, state, req, text)
    images = []
    if sources:
        # Images load and process in the media workers; their placeholders then expand.
        ids, images = await state.media.prepare(ids, sources, "messages")
        ((text, ids),) = await asyncio.to_thread(
            validate_prompts,
            state,
            [(text, ids)],
            params,
            "messages",
            images=True,
            max_tokens_field=_given_max_tokens(req),
        )
    reasoning = state.reasoning_parser if _separates_reasoning(req) else None
    return ChatResponse(state, req, [(text, ids)], params, plan, [images], reasoning)


async def _beam_search(
    state: ServerState, req: ChatCompletionRequest, response: ChatResponse, request: Request
) -> Response:
    """vLLM's `use_beam_search` on chat: the rendered prompt's `n` best beams
    (`serving_beam`); without `max_tokens`, up to the context."""
    ((_, ids),) = response.prompts
    if response.images and response.images[0]:
        raise APIError(400, "messages: images are not taken with use_beam_search", "messages")
    if response.reasoning is not None:
        raise APIError(
            400,
            "use_beam_search: not with the server's reasoning parser (a beam's text would "
            "hold its thinking)",
            "use_beam_search",
        )
    max_tokens = response.params.max_tokens
    if max_tokens is None:
        max_tokens = state.tm.ready.context_length - len(ids)
    beam = beam_params(req, response.params, state.tokenizer is not None, max_tokens)
    return await beam_response(state, req, response.prompts, beam, request)


@dataclass(frozen=True)
class ReasoningTextDelta:
    """A piece of the reasoning, under both names clients read: `reasoning_content` (SGLang,
    DeepSeek) and `reasoning` (vLLM's newer name)."""

    text: str

    def to_openai(self) -> dict[str, Any]:
        return {"reasoning_content": self.text, "reasoning": self.text}


class SeparatedStream(ToolCallStream):
    """One choice's output with its reasoning split off: reasoning deltas for the thinking,
    then the deltas of `calls` (its tool-call stream) fed the content that follows, or that
    content as content deltas when there is no tool-call stream."""

    def __init__(self, reasoning: ReasoningParser, calls: ToolCallStream | None) -> None:
        super().__init__()
        self.reasoning = reasoning
        self.calls = calls

    @property
    def num_calls(self) -> int:
        return self.calls.num_calls if self.calls is not None else 0

    def _consume(self, text: str) -> None:
        self._route(self.reasoning.feed(text))

    def _end(self) -> None:
        self._route(self.reasoning.finish())
        if self.calls is not None:
            self._out += self.calls.finish()

    def _route(self, d: ReasoningDelta) -> None:
        if d.reasoning:
            self._out.append(ReasoningTextDelta(d.reasoning))  # type: ignore[arg-type]
        if not d.content:
            return
        if self.calls is not None:
            self._out += self.calls.feed(d.content)
        else:
            self._out.append(ContentDelta(d.content))


def _chat_logprobs(state: ServerState, c: Choice, top: int) -> dict[str, Any]:
    content = []
    for lp in c.logprobs:
        tok = text_of(state, lp.token_id, c.token_texts)
        content.append(
            {
                "token": tok,
                "logprob": lp.logprob,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {
                        "token": (t := text_of(state, tid, c.token_texts)),
                        "logprob": v,
                        "bytes": list(t.encode()),
                    }
                    for tid, v in lp.top[:top]
                ],
            }
        )
    return {"content": content}


def _template_messages(state: ServerState, req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (`tokenizer.chat.template_messages`)."""
    try:
        return template_messages(_dumped(req), _placeholder(state))[0]
    except ParamError as e:
        raise APIError(400, str(e), "messages") from None


def _chat_prompt(
    state: ServerState, req: ChatCompletionRequest, plan: ToolPlan | None, rendered: str | None
) -> ChatPrompt:
    """The request's conversation made a prompt (`tokenizer.chat.chat_prompt`, as `LLM.chat`
    makes it), with the server's chat template unless a request's own `rendered` it."""
    try:
        return chat_prompt(
            state.tokenizer,
            _dumped(req),
            _placeholder(state),
            add_generation_prompt=req.add_generation_prompt,
            tools=plan.template_tools if plan else None,
            template_kwargs=template_kwargs(state, req),
            continue_final_message=req.continue_final_message,
            documents=req.documents,
            rendered=rendered,
            max_chars=state.max_prompt_chars,
        )
    except ParamError as e:
        # Named as a whole: where a message sits on the chat path is not always where it sits
        # in the request (the Responses API puts its history and instructions first).
        raise APIError(400, str(e), "messages") from None


def in_tools_terms(e: APIError, req: ChatCompletionRequest) -> APIError:
    """A refusal of the constraint braid made from the request's tools (tool_choice
    "required" or a named function: a JSON schema; strict tools: a structural tag) names
    `tools`, the field the client sent, not the constraint's kind."""
    kinds = ("json_schema", "structural_tag")
    if not req.tools or e.param not in kinds or req.constraint_fields():
        return e
    return APIError(e.status, "tools: " + e.message.removeprefix(f"{e.param}: "), "tools", e.kind)


def check_template_fields(req: Any) -> None:
    """An `APIError` naming the field for `chat_template_kwargs` or `continue_final_message`
    that the template cannot take (rendering would find them too, but name `messages`)."""
    try:
        check_template_kwargs(req.chat_template_kwargs)
    except ParamError as e:
        raise APIError.refused(e) from None
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message: not with add_generation_prompt (set it to false)",
            "continue_final_message",
        )


def template_kwargs(state: ServerState, req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The template variables of `req`: `chat_template_kwargs`, and OpenAI's
    `reasoning_effort` where the chat template reads that variable (gpt-oss's does); an
    `APIError` refuses it where the template would ignore it."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    if "reasoning_effort" in (req.chat_template_kwargs or {}):
        raise APIError(
            400, "reasoning_effort: given twice (also in chat_template_kwargs)", "reasoning_effort"
        )
    if not template_reads(state.tokenizer, req.chat_template, "reasoning_effort"):
        raise APIError(
            400,
            "reasoning_effort: this model's chat template does not read it (a template "
            "variable such as enable_thinking goes in chat_template_kwargs)",
            "reasoning_effort",
        )
    return {**(req.chat_template_kwargs or {}), "reasoning_effort": req.reasoning_effort}


def chat_prompt_of(state: ServerState, req: ChatCompletionRequest) -> ChatPrompt:
    """`req`'s conversation and tools as the server's chat template renders them (what
    `/tokenize` counts for messages); an `APIError` names what is wrong."""
    return _chat_prompt(state, req, _tool_plan(state, req), None)


def _dumped(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in req.messages]


def _placeholder(state: ServerState) -> str | None:
    """The prompt text of one image (None for a model that takes no images); an `APIError`
    for a model without a tokenizer, which cannot render a chat."""
    if state.tokenizer is None:
        raise APIError(400, "messages: this model has no tokenizer or chat template", "messages")
    return state.media.placeholder if state.media.supports_images else None


def _tool_plan(state: ServerState, req: ChatCompletionRequest) -> ToolPlan | None:
    # A ParamError names the field (tools[i].function.name, tool_choice, ...).
    return ToolPlan.resolve(
        req.tools, req.tool_choice, req.parallel_tool_calls, parser=state.tool_call_parser
    )


def _thinking_closed(prompt: str, cls: type[ReasoningParser]) -> bool:
    """Whether the prompt ends after a closed thinking block (e.g. Qwen3's template with
    `enable_thinking=False` writes an empty one), so the output is all answer."""
    end = prompt.rfind(cls.end)
    return end >= 0 and end > prompt.rfind(cls.start) and not cls.starts_in_reasoning(prompt)


def _separates_reasoning(req: ChatCompletionRequest) -> bool:
    """SGLang's `separate_reasoning` (default true): false returns the raw text as content."""
    return req.separate_reasoning


def _chat_message(
    c: Choice, plan: ToolPlan | None, reasoning: ReasoningParser | None = None
) -> tuple[AssistantMessage, str | None]:
    """The assistant message of a finished choice and its finish reason: with `reasoning`,
    the thinking goes to `reasoning_content` (and `reasoning`), and the rest is the text that
    becomes the content and tool calls."""
    text, thought = c.text, None
    if reasoning is not None:
        thought, text = reasoning.split(c.text)

    def message(content: str | None, calls: list[ToolCall] | None = None) -> AssistantMessage:
        m: dict[str, Any] = {"content": content}
        if reasoning is not None:
            m["reasoning_content"] = m["reasoning"] = thought or None
        if calls:
            m["tool_calls"] = [call.to_openai() for call in calls]
        return AssistantMessage(**m)

    if plan is None:
        return message(text), finish_of(c)
    content, calls = plan.parse(text)
    if finish_of(c) == "length":
        # Cut off by max_tokens: a call whose arguments did not finish is no call (OpenAI sends
        # finish_reason "length" and no broken tool_calls); the text is the content.
        calls = [call for call in calls if _is_json_object(call.arguments)]
        if not calls:
            return message(text), "length"
    if not calls:
        return message(content), finish_of(c)
    return message(content or None, calls), finish_reason(finish_of(c), len(calls))


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
