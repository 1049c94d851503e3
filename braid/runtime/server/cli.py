"""`braid serve` (also `python -m braid serve`): flags generated from the settings' fields.

Every engine setting is a field of `EngineConfig` and every server setting a field of
`ServerSettings`; each field gives one flag, `--field-name`, with its type, its choices, its
doc as help and its default, plus SGLang's names for it as aliases (`--max-total-tokens` is
`--kv-tokens`). The parsed namespace holds the fields by name.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import re
import signal
import sys
import time
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from braid._logging import configure_logging
from braid.runtime.config import EngineConfig
from braid.runtime.config_fields import check_choices, choices_of, setting
from braid.runtime.config_keywords import other_engines_hint, speculative_settings
from braid.runtime.function_call import PARSER_NAMES
from braid.runtime.reasoning import PARSER_NAMES as REASONING_PARSER_NAMES
from braid.runtime.reasoning import get_parser as get_reasoning_parser
from braid.runtime.sampling_params import defaults_from_generation_config
from braid.runtime.server.guard import MAX_BODY_BYTES
from braid.runtime.server.http import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_S,
    ServerStartError,
    bind_listener,
)

logger = logging.getLogger("braid.serve")

# A server logs for operators and draws no progress bars: serve's one departure from the
# library's defaults (`--show-progress` turns it back on).
SERVE_DEFAULTS: dict[str, Any] = {"show_progress": False}
# Allocations between the server process's young-generation collections (Python's default: 700).
SERVER_GC_THRESHOLD = 50_000


def overlap_startup() -> bool:
    """Whether `braid serve` starts the runtime's processes before it loads the tokenizer, so
    that the model loads meanwhile: yes, unless BRAID_OVERLAP_STARTUP=0 (for A/B runs:
    benchmarks/startup.py; on a quiet 2-core machine SmolLM2 was ready in 3.35 s against
    4.21 s one after the other, median of 5, docs/benchmarks.md)."""
    return os.environ.get("BRAID_OVERLAP_STARTUP") != "0"


@dataclass(frozen=True)
class ServerSettings:
    """`braid serve`'s own settings (the engine's are `EngineConfig`), declared as its are."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(30000, "port to listen on")
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' (not on /health); also $BRAID_API_KEY, and "
        "--api-key-file reads it from a file, which keeps it out of the process list",
    )
    api_key_file: str | None = setting(None, "a file holding the API key")
    chat_template: str | None = setting(
        None, "a Jinja template file or string; unset: the tokenizer's"
    )
    tool_call_parser: str = setting(
        "auto",
        "how tool_choice 'auto' reads calls from the text; auto: detected from the chat "
        "template; none: never parse",
        choices=("auto", "none", *PARSER_NAMES),
    )
    reasoning_parser: str | None = setting(
        None,
        "split a reasoning model's thinking (<think>...</think>) from its answer: chat "
        "responses carry it as reasoning_content (and reasoning); unset: no split",
        choices=REASONING_PARSER_NAMES,
    )
    served_model_name: str | None = setting(
        None, "the name /v1/models reports and responses carry; unset: the --model value"
    )
    strict_model_name: bool = setting(
        False,
        "answer 404 to a request naming another model; off: the one model serves whatever "
        "name is given, as in SGLang",
    )
    max_request_bytes: int = setting(
        MAX_BODY_BYTES, "largest request body in bytes, counted as it arrives"
    )
    max_samples_per_request: int = setting(
        128, "most samples one request may ask for, n x prompts (OpenAI's n limit)"
    )
    allow_request_chat_template: bool = setting(
        False,
        "accept a chat_template field in chat requests (rendered in a sandbox process with a "
        "time and size limit); refused by default",
    )
    allowed_origins: str = setting(
        "",
        "comma-separated browser origins allowed to call the server (CORS; '*' for any); "
        "unset: cross-origin browser requests are refused",
    )
    allowed_hosts: str = setting(
        "",
        "comma-separated Host names the server answers besides its own (a reverse proxy's "
        "public name; '*' for any); others get 403 (DNS rebinding)",
    )
    header_timeout: float = setting(
        HEADER_TIMEOUT_S, "seconds a client has to send a request's headers"
    )
    body_timeout: float = setting(BODY_TIMEOUT_S, "seconds a client has to send a request's body")
    keep_alive_timeout: float = setting(
        KEEP_ALIVE_S, "seconds an idle keep-alive connection stays open"
    )
    health_timeout: float = setting(
        120.0,
        "/health fails when the scheduler is in one step this long; it also fails after "
        "--heartbeat-timeout without the scheduler's heartbeat",
    )
    heartbeat_timeout: float = setting(
        10.0, "/health fails when the scheduler sends no heartbeat this long"
    )
    response_store: str | None = setting(
        None,
        "the SQLite file where /v1/responses keeps stored responses (store: true) for "
        "previous_response_id and GET/DELETE /v1/responses/{id}; unset: responses.sqlite3 "
        "under braid's cache dir",
    )
    response_store_size: int = setting(
        10_000, "most responses the response store keeps; storing more deletes the oldest"
    )
    log_requests: bool = setting(
        False,
        "log one line per request as it ends: client, method, path, status, seconds",
        aliases=("--enable-log-requests",),  # vLLM's
    )
    log_level: str | None = setting(
        None,
        "log level; unset: $BRAID_LOG_LEVEL, else info",
        choices=("debug", "info", "warning", "error", "critical"),
    )
    dp_size: int = setting(
        1,
        "data parallelism: this many braid serve workers (one per GPU) behind SGLang's router "
        "on --host/--port (pip install 'braid[router]')",
    )
    router_policy: str = setting(
        "cache_aware",
        "with --dp-size: how the router picks a worker (cache_aware: the one holding the "
        "longest prefix of the request, load permitting)",
        choices=("cache_aware", "round_robin", "random", "power_of_two"),
    )

    def __post_init__(self) -> None:
        check_choices(self)
        if self.max_samples_per_request < 1:
            raise ValueError("max_samples_per_request must be at least 1")
        if self.response_store_size < 1:
            raise ValueError("response_store_size must be at least 1")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        for name in _SECONDS:
            t = getattr(self, name)
            if not 0 < t < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {t:g}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError(
                "api_key is empty (an unset variable?): give the key, or leave the flag out "
                "to serve without one"
            )
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"dp_size must be a positive integer, got {self.dp_size!r}")

    @property
    def origins(self) -> tuple[str, ...]:
        return tuple(o.strip() for o in self.allowed_origins.split(",") if o.strip())

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip())


_SECONDS = ("header_timeout", "body_timeout", "keep_alive_timeout", "health_timeout",
            "heartbeat_timeout")  # fmt: skip


def _flag_type(hint: Any) -> type:
    """`int` for `int | None`: the type a flag's value converts to."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _default_note(default: Any) -> str:
    if default is None or default == "":
        return ""  # the doc says what unset means
    if isinstance(default, bool):
        return f" (default: {'on' if default else 'off'})"
    if isinstance(default, float):
        return f" (default: {default:g})"
    return f" (default: {default})"


def add_setting_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """One flag per field of the settings dataclass `cls` (its dest is the field name), as
    the module docstring says. A bool field that defaults to False is a bare flag; one that
    defaults to True or None has `--name` and `--no-name` (and its `off_flag`). `defaults`
    replaces a field's default for this parser."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        default = (defaults or {}).get(f.name, f.default)
        flag = "--" + f.name.replace("_", "-")
        names = (flag, *f.metadata["aliases"])
        doc = f.metadata["doc"].replace("%", "%%")
        kind = _flag_type(hints[f.name])
        off_flag = f.metadata["off_flag"]
        if kind is bool and default is False and off_flag is None:
            parser.add_argument(
                *names, dest=f.name, action="store_true", help=doc + " (default: off)"
            )
        elif kind is bool:
            parser.add_argument(
                *names,
                dest=f.name,
                action="store_const",
                const=True,
                default=default,
                help=doc + _default_note(default),
            )
            off = ("--no-" + flag[2:], *((off_flag,) if off_flag else ()))
            parser.add_argument(
                *off,
                dest=f.name,
                action="store_const",
                const=False,
                default=default,
                help=f"turn {flag} off",
            )
        else:
            choices = choices_of(f)
            fixed = not callable(f.metadata["choices"])
            if choices is not None and not fixed:
                doc += "; registered: " + ", ".join(map(str, choices))
            parser.add_argument(
                *names,
                dest=f.name,
                type=kind,
                default=default,
                choices=choices if fixed else None,
                metavar=None if fixed and choices is not None else kind.__name__.upper(),
                help=doc + _default_note(default),
            )


def settings_from_args(cls: type, args: argparse.Namespace) -> Any:
    """The settings dataclass `cls` built from the fields of parsed flags (`ValueError` from
    its validation). For `EngineConfig`, vLLM's `--speculative-config` JSON stands for the
    speculative flags it sets (given twice is a `ValueError`)."""
    values = {f.name: getattr(args, f.name) for f in fields(cls)}
    raw = getattr(args, "speculative_config", None)
    if cls is EngineConfig and raw is not None:
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config: not JSON: {e}") from None
        defaults = {f.name: f.default for f in fields(cls)}
        for name, value in speculative_settings(spec).items():
            if values[name] != defaults[name]:
                raise ValueError(f"{name} is given twice: as a flag and in --speculative-config")
            values[name] = value
    return cls(**values)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="braid", description="braid: LLM programs and serving")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="Run the OpenAI-compatible server. Each flag is a settings field by name; "
        "SGLang's names for them are aliases.",
    )
    engine = s.add_argument_group("engine settings (braid.LLM takes them as keywords)")
    add_setting_flags(engine, EngineConfig, SERVE_DEFAULTS)
    engine.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="vLLM's speculative_config as JSON (method, model, num_speculative_tokens, "
        "prompt_lookup_min, prompt_lookup_max): the --speculative-* flags it stands for",
    )
    add_setting_flags(s.add_argument_group("server settings"), ServerSettings)
    return ap


def as_flags(message: str) -> str:
    """A settings error as the command line spells it: `kv_tokens` as `--kv-tokens (--max-...)`."""
    named = {f.name: f for cls in (EngineConfig, ServerSettings) for f in fields(cls)}
    words = sorted((n for n in named if "_" in n), key=len, reverse=True)  # plain words stay

    def flag(m: re.Match[str]) -> str:
        f = named[m.group(0)]
        other = f.metadata["aliases"]
        return "--" + f.name.replace("_", "-") + (f" ({', '.join(other)})" if other else "")

    return re.sub(r"(?<![\w-])(" + "|".join(words) + r")(?![\w-])", flag, message)


def _api_key(settings: ServerSettings | argparse.Namespace) -> str | None:
    """The key from --api-key, else --api-key-file, else $BRAID_API_KEY (ValueError if the
    file cannot be read or is empty)."""
    if settings.api_key:
        return settings.api_key
    if settings.api_key_file:
        try:
            key = open(settings.api_key_file).read().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file: {settings.api_key_file} is empty")
        return key
    return os.environ.get("BRAID_API_KEY") or None


def startup_summary(
    phases: dict[str, float],
    scheduler: dict[str, float],
    alongside: dict[str, float],
    total: float | None,
    load_parts: dict[str, float] | None = None,
) -> str:
    """The start-up phases for the ready line, one after the other, with the scheduler's own
    phases (its "load" split into `load_parts`, in brackets) and the front end's work done
    meanwhile (`alongside`) inside the runtime's: `in 5.10 s: imports 1.20 s, runtime 3.50 s
    (scheduler: process start 0.40 s, load 2.90 s [weights 1.00 s, kv cache 0.10 s, graphs
    1.70 s, rest 0.10 s]; alongside: tokenizer 0.30 s), server 0.10 s`."""

    def listed(d: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.2f} s" for k, v in d.items())

    parts = []
    for name, secs in phases.items():
        parts.append(f"{name} {secs:.2f} s")
        if name == "runtime":
            inner = []
            if scheduler:
                shown = listed(scheduler)
                if load_parts and "load" in scheduler:
                    load = f"load {scheduler['load']:.2f} s"
                    shown = shown.replace(load, f"{load} [{listed(load_parts)}]")
                inner.append("scheduler: " + shown)
            if alongside:
                inner.append("alongside: " + listed(alongside))
            if inner:
                parts[-1] += f" ({'; '.join(inner)})"
    head = f"in {total:.2f} s: " if total is not None else "phases: "
    return head + ", ".join(parts)


def serve(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from braid.runtime.ipc.sockets import since_process_start

    entered = time.perf_counter()
    before_serve = since_process_start()
    # Only what starts the runtime is imported before it starts: its processes then import
    # torch and load the model while this process imports the rest (the HTTP app, the media
    # front end, which need torch too) and loads the tokenizer.
    from braid.runtime.assets import ModelAssets
    from braid.runtime.launch import spawn_runtime
    from braid.runtime.tokenizer.manager import TokenizerManager
    from braid.runtime.tokenizer.tokenizer import read_chat_template, word_encoder

    # Start-up phases for the ready line: the interpreter and braid's imports, the runtime (its
    # processes' start to the model loaded, with the scheduler's own phases; the tokenizer
    # loads alongside), the server.
    phases: dict[str, float] = {}
    if before_serve is not None:
        phases["imports"] = before_serve + time.perf_counter() - entered
    level = (args.log_level or os.environ.get("BRAID_LOG_LEVEL") or "info").upper()
    configure_logging(level)
    try:
        config = settings_from_args(EngineConfig, args)
        settings = settings_from_args(ServerSettings, args)
        api_key = _api_key(settings) if config.node_rank == 0 else None  # others serve no HTTP
        assets = ModelAssets.load(  # small JSON files; the tokenizer loads below
            config.model,
            with_tokenizer=False,
            revision=config.revision,
            gguf_file=config.gguf_file,
        )
        assets.config.check_engine(config)  # before any process starts
    except ValueError as e:
        logger.error("braid serve: %s", as_flags(str(e)))
        return 2
    if settings.dp_size > 1:
        from braid.runtime.server.data_parallel import serve_data_parallel

        argv = list(sys.argv[1:] if argv is None else argv)
        return serve_data_parallel(argv, settings, config, api_key)
    if config.node_rank > 0:
        # Another machine of a multi-node tensor-parallel group: its ranks only, no server.
        from braid.runtime.executor.tp_worker import serve_followers
        from braid.runtime.launch import use_braid_triton_cache

        use_braid_triton_cache()
        return serve_followers(config, assets.path, level)
    try:
        chat_template = settings.chat_template and read_chat_template(settings.chat_template)
        listener = bind_listener(settings.host, settings.port)  # before the model loads
    except (ValueError, ServerStartError) as e:
        logger.error("braid serve: %s", as_flags(str(e)))
        return 2

    def on_failure(message: str) -> None:
        logger.error("braid serve: shutting down: %s", message)
        os.kill(os.getpid(), signal.SIGTERM)

    tm = TokenizerManager(
        config,
        assets.path,
        assets.eos_token_ids,
        spawn=spawn_runtime,
        log_level=level,
        on_failure=on_failure,
    )
    # The runtime's processes start now and load the model while this process loads the
    # tokenizer (transformers' import and the tokenizer files: seconds) and the media front end.
    overlap = overlap_startup()
    if overlap:
        tm.spawn_early()
    alongside: dict[str, float] = {}
    mark = time.perf_counter()
    try:
        from braid.runtime.ipc.sockets import freeze_startup_heap
        from braid.runtime.multimodal.frontend import MediaFrontend
        from braid.runtime.server.app import ServerState, create_app
        from braid.runtime.server.http import run_server
        from braid.runtime.tokenizer.template_sandbox import TemplateSandbox
    except BaseException:
        asyncio.run(tm.shutdown())  # the runtime started: stop it before failing
        raise
    if overlap:
        alongside["server imports"] = time.perf_counter() - mark
    elif "imports" in phases:
        phases["imports"] += time.perf_counter() - mark
    try:
        mark = time.perf_counter()
        assets.load_tokenizer()
        media = MediaFrontend(config, assets.path, assets.config, assets.tokenizer)
        (alongside if overlap else phases)["tokenizer"] = time.perf_counter() - mark
    except ValueError as e:
        logger.error("braid serve: %s", as_flags(str(e)))
        asyncio.run(tm.shutdown())
        return 2
    model_path, tokenizer = assets.path, assets.tokenizer
    tm.encode_words = word_encoder(tokenizer)
    if chat_template and tokenizer is not None:
        tokenizer.chat_template = chat_template

    from braid.runtime.function_call import resolve_parser_name

    tool_call_parser = resolve_parser_name(
        settings.tool_call_parser, tokenizer.chat_template if tokenizer is not None else None
    )
    logger.info("braid serve: tool-call parser: %s", tool_call_parser or "none")
    reasoning_parser = (
        get_reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser else None
    )
    if reasoning_parser is not None:
        logger.info("braid serve: reasoning parser: %s", settings.reasoning_parser)

    name = settings.served_model_name or (config.model or "smollm2-135m")
    shown = {k: v for k, v in asdict(settings).items() if not k.startswith("api_key")}
    defaults = assets.default_sampling_params(config.generation_config)
    gen_max_tokens = config.generation_config != "braid" and "max_tokens" in (
        defaults_from_generation_config(assets.generation_config)
    )
    state = ServerState(
        tm=tm,
        tokenizer=tokenizer,
        served_model_name=name,
        model_path=str(model_path),
        defaults=defaults,
        chat_max_tokens=defaults.max_tokens if gen_max_tokens else None,
        media=media,
        api_key=api_key,
        max_body_bytes=settings.max_request_bytes,
        server_args={**asdict(config), **shown},
        tool_call_parser=tool_call_parser,
        raw_tool_calls=settings.tool_call_parser == "none",
        reasoning_parser=reasoning_parser,
        strict_model_name=settings.strict_model_name,
        bind_host=settings.host,
        allowed_origins=settings.origins,
        max_samples=settings.max_samples_per_request,
        allow_request_chat_template=settings.allow_request_chat_template,
        template_sandbox=TemplateSandbox(str(model_path))
        if settings.allow_request_chat_template and tokenizer is not None
        else None,
        health_stuck_s=settings.health_timeout,
        health_silent_s=settings.heartbeat_timeout,
        allowed_hosts=settings.hosts,
    )

    def on_ready() -> None:
        freeze_startup_heap()  # full collections then skip everything start-up made
        # Streams allocate per step (an output per stream, its chunk, a wake-up), and with
        # Python's default threshold (700) the collector runs every few hundred of those
        # allocations, scanning every live stream's objects each time. That garbage is acyclic
        # and freed by reference counts, so the young generation is collected less often.
        gc.set_threshold(SERVER_GC_THRESHOLD, *gc.get_threshold()[1:])
        r = tm.ready
        phases["runtime"] = tm.start_time_s
        phases["server"] = time.perf_counter() - serving_at - tm.start_wait_s
        load_parts = dict(r.phases)
        started = load_parts.pop("process start", None)
        scheduler = {"process start": started} if started is not None else {}
        scheduler["load"] = r.load_time_s
        total = None if before_serve is None else before_serve + time.perf_counter() - entered
        logger.info(
            "braid serve: ready at http://%s:%d (model %s, %s %s, context %d, KV %d tokens) %s",
            settings.host,
            listener.getsockname()[1],  # the port the system chose for --port 0
            name,
            r.device,
            r.dtype,
            r.context_length,
            r.kv_capacity_tokens,
            startup_summary(phases, scheduler, alongside, total, load_parts),
        )

    app = create_app(state, on_ready=on_ready)
    serving_at = time.perf_counter()
    try:
        run_server(
            app,
            settings.host,
            settings.port,
            header_timeout_s=settings.header_timeout,
            body_timeout_s=settings.body_timeout,
            keep_alive_s=settings.keep_alive_timeout,
            sock=listener,
            log_requests=settings.log_requests,
        )
    except Exception as e:  # start-up failures (model, port) end with one clear line
        logger.error("braid serve: %s", as_flags(str(e)))
        asyncio.run(tm.shutdown())  # the runtime started before the server (nothing if done)
        return 1
    if tm.failure:
        logger.error("braid serve: exited after a runtime failure: %s", tm.failure)
        return 1
    logger.info("braid serve: exit 0")
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    hints = [other_engines_hint(a.split("=")[0]) for a in unknown if a.startswith("--")]
    if any(hints):
        parser.error(f"unrecognized arguments: {' '.join(unknown)} ({next(filter(None, hints))})")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "serve":
        try:
            code = serve(args, argv)
        except KeyboardInterrupt:  # Ctrl-C before the server runs (which handles its own)
            print("braid serve: interrupted during start-up", file=sys.stderr)
            code = 130
        sys.exit(code)


if __name__ == "__main__":
    main()
