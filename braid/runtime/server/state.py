"""`ServerState`: what every route of one server reads (the runtime, the tokenizer, the
operator's settings)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from braid.runtime.multimodal.frontend import MediaFrontend
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.server.guard import MAX_BODY_BYTES
from braid.runtime.server.metrics import ServerMetrics
from braid.runtime.server.session_trees import SessionTrees
from braid.runtime.tokenizer.manager import TokenizerManager
from braid.runtime.tokenizer.roles import RoleTemplate, role_template
from braid.runtime.tokenizer.template_sandbox import TemplateSandbox

if TYPE_CHECKING:
    from braid.runtime.reasoning.base import ReasoningParser


@dataclass
class ServerState:
    tm: TokenizerManager
    tokenizer: Any
    served_model_name: str
    model_path: str
    defaults: SamplingParams
    media: MediaFrontend
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    sessions: SessionTrees = field(default_factory=SessionTrees)  # opened with /open_session
    server_args: dict[str, Any] = field(default_factory=dict)
    tool_call_parser: str | None = None  # the format parser for tool_choice "auto"
    # --tool-call-parser none: "auto" returns the model's text as it is, on purpose (with no
    # parser otherwise, "auto" is refused).
    raw_tool_calls: bool = False
    # --reasoning-parser: chat outputs split into reasoning_content and content.
    reasoning_parser: type[ReasoningParser] | None = None
    strict_model_name: bool = False  # 404 for a model name that is not the served one
    bind_host: str = "127.0.0.1"
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_samples: int = 128  # samples one request may ask for (n x prompts)
    # A request's own chat_template: refused unless allowed; then rendered in a sandbox process.
    allow_request_chat_template: bool = False
    template_sandbox: TemplateSandbox | None = None
    # /health fails when the scheduler sends no heartbeat for this long, or is in one step
    # for longer than health_stuck_s.
    health_silent_s: float = 10.0
    health_stuck_s: float = 120.0
    # Chat's and the Responses API's max_tokens when a body gives none: the model's
    # generation_config max_new_tokens, else None (up to the context, as vLLM and SGLang).
    # /v1/completions keeps OpenAI's 16 (`defaults`).
    chat_max_tokens: int | None = None

    @functools.cached_property
    def role_template(self) -> RoleTemplate:
        """The chat template's role boundaries, for language clients (RuntimeEndpoint)."""
        return role_template(self.tokenizer)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Text longer than this cannot fit the context, whatever it says: every token spells
        at most the longest vocabulary entry (twice that, for normalisers that shrink text).
        Such a prompt is refused without being tokenized, since tokenizing a long text takes
        seconds (measured: docs/benchmarks.md, Figures behind design choices)."""
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return 2 * max(longest, 1) * self.tm.ready.context_length
