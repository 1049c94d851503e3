"""Rendering a chat template a client sent, in a process that can be stopped.

A chat template is a program: `{{ 'x' * 50000000 }}` is 59 bytes that make 50 MB, and two
nested loops over `range(100000)` run for hours. The operator's template is trusted and renders
on a worker thread of the server; a template that came with a request (accepted only with
`--allow-request-chat-template`) renders here: in one worker process, started once and reused,
that is killed and replaced when a render overruns its time limit. Inside the worker, jinja's
sandbox refuses any `*`, `+` or `**` whose result would pass the output limit, the output is
counted as it is joined, and the worker's address space is capped (`RLIMIT_AS`, 1 GiB past
what it holds after loading the tokenizer), so a template that builds large strings some other
way (`'%09000000d' % 1`, `center`) fails with a MemoryError in the worker instead of taking
the machine's memory. Renders run one at a time on the sandbox's own thread, so a slow
template never occupies the server's worker threads.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from braid.runtime.errors import ParamError

logger = logging.getLogger(__name__)

# A request's template gets this long to render (seconds), and may produce this many characters.
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_CHARS = 4 * 1024 * 1024
# The worker loads the tokenizer (its special tokens feed the template) once, at start.
_START_TIMEOUT_S = 120.0
_MEMORY_HEADROOM = 1 << 30


def _limit_sandbox(max_chars: int) -> None:
    """Make jinja's sandbox (which transformers renders chat templates in) refuse arithmetic
    whose result is too large to be part of a prompt. Only ever called in the worker process."""
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def size(x: Any) -> int | None:
        return len(x) if isinstance(x, (str, list, tuple)) else None

    base = ImmutableSandboxedEnvironment.call_binop

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                n = size(seq)
                if n is not None and isinstance(times, int) and n * times > max_chars:
                    raise SecurityError(f"'*' would make {n * times} items (limit {max_chars})")
        elif operator == "+":
            a, b = size(left), size(right)
            if a is not None and b is not None and a + b > max_chars:
                raise SecurityError(f"'+' would make {a + b} items (limit {max_chars})")
        elif operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise SecurityError(f"'**' with exponent {right} is refused (at most 64)")
        return base(self, context, operator, left, right)

    def concat(pieces) -> str:
        out, total = [], 0
        for piece in pieces:
            total += len(piece)
            if total > max_chars:
                raise SecurityError(f"the output passed {max_chars} characters")
            out.append(piece)
        return "".join(out)

    ImmutableSandboxedEnvironment.intercepted_binops = frozenset({"*", "+", "**"})
    ImmutableSandboxedEnvironment.call_binop = call_binop
    ImmutableSandboxedEnvironment.concat = staticmethod(concat)  # type: ignore[assignment]


def _cap_memory(extra_bytes: int) -> None:
    """Limit this process's address space to what it maps now plus `extra_bytes`."""
    import resource

    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _worker(model_path: str, max_chars: int, conn: Connection) -> None:
    from braid.runtime.ipc.children import die_with_parent
    from braid.runtime.tokenizer.tokenizer import load_tokenizer, render_chat

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops it (a group's Ctrl-C)
    die_with_parent()
    _limit_sandbox(max_chars)
    tokenizer = load_tokenizer(model_path)
    render_chat(tokenizer, [{"role": "user", "content": "x"}], chat_template="{{ 'x' }}")
    _cap_memory(_MEMORY_HEADROOM)
    conn.send(("ready", None))
    while True:
        try:
            messages, kwargs = conn.recv()
        except EOFError:
            return
        try:
            text = render_chat(tokenizer, messages, **kwargs)
        except ValueError as e:
            conn.send(("error", str(e)))
            continue
        if len(text) > max_chars:
            conn.send(
                ("error", f"the rendered prompt is {len(text)} characters (limit {max_chars})")
            )
        else:
            conn.send(("ok", text))


class TemplateSandbox:
    """One render worker for request templates; `render` is blocking (call it off the event
    loop) and serialised (one render at a time). Errors are `ParamError`s naming
    `chat_template`."""

    def __init__(
        self,
        model_path: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        self.model_path = model_path
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._lock = threading.Lock()
        # Requests' renders queue here, not on the server's shared worker threads.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="braid-template")
        self._proc: mp.Process | None = None
        self._conn: Connection | None = None

    def start(self) -> None:
        """Start the worker now (else the first render starts it)."""
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_worker,
            args=(self.model_path, self.max_chars, child),
            name="braid-template-sandbox",
            daemon=True,
        )
        from braid.runtime.ipc.children import without_main_reimport

        with without_main_reimport():
            proc.start()
        child.close()
        try:
            started = parent.poll(_START_TIMEOUT_S) and parent.recv()
        except (EOFError, OSError):
            started = False
        if not started:
            proc.kill()
            raise RuntimeError("the chat template worker did not start")
        self._proc, self._conn = proc, parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        with self._lock:
            self._ensure_started()
            assert self._conn is not None
            t0 = time.perf_counter()
            self._conn.send((messages, kwargs))
            try:
                ready = self._conn.poll(self.timeout_s)
                status, value = self._conn.recv() if ready else ("timeout", None)
            except (EOFError, OSError):
                status, value = "died", None
            if status in ("timeout", "died"):
                self._kill()
                logger.warning(
                    "a request's chat template %s after %.1f s; its worker was replaced",
                    "overran" if status == "timeout" else "killed its worker",
                    time.perf_counter() - t0,
                )
                if status == "timeout":
                    raise ParamError.at(
                        "chat_template",
                        f"rendering took longer than {self.timeout_s:g} s "
                        "(the limit for a request's template)",
                    )
                raise ParamError.at("chat_template", "rendering failed (it ran out of memory)")
            if status == "error":
                raise ParamError.at("chat_template", str(value))
            return value

    def close(self) -> None:
        with self._lock:
            self._kill()
        self.executor.shutdown(wait=False, cancel_futures=True)
