"""`braid serve` (also `python -m braid serve`): flags named as SGLang names them."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from braid._logging import configure_logging
from braid.runtime.function_call import PARSER_NAMES
from braid.runtime.server.guard import MAX_BODY_BYTES
from braid.runtime.server.http import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, KEEP_ALIVE_S

logger = logging.getLogger("braid.serve")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="braid", description="braid: LLM programs and serving")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the OpenAI-compatible server")
    s.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=None,
        help="HF directory, .gguf file, or 'smollm2-135m' (default: embedded)",
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (also $BRAID_API_KEY; --api-key-file reads "
        "it from a file, which keeps it out of the process list)",
    )
    s.add_argument("--api-key-file", default=None, help="a file holding the API key")
    s.add_argument("--dtype", default="auto")
    s.add_argument("--device", default=None)
    s.add_argument("--context-length", type=int, default=None)
    s.add_argument("--max-running-requests", type=int, default=None)
    s.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    s.add_argument("--mem-fraction-static", type=float, default=None)
    s.add_argument("--max-prefill-tokens", type=int, default=None)
    s.add_argument("--chunked-prefill-size", type=int, default=None, help="-1 turns it off")
    s.add_argument("--page-size", type=int, default=1)
    s.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs"])
    s.add_argument("--disable-radix-cache", action="store_true")
    s.add_argument("--chat-template", default=None, help="a Jinja template file or string")
    s.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "none", *PARSER_NAMES],
        help="how tool_choice 'auto' reads calls from the text (default: auto, detected from "
        "the chat template; none: never parse)",
    )
    s.add_argument("--served-model-name", default=None)
    s.add_argument(
        "--strict-model-name",
        action="store_true",
        help="answer 404 to a request naming another model (default: serve the one model "
        "whatever name is given, as SGLang does)",
    )
    s.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    s.add_argument(
        "--attention-backend",
        default=None,
        help="triton or torch_native (default: triton on CUDA, torch_native on CPU)",
    )
    s.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=160,
        help="largest decode batch replayed from a CUDA graph (default: 160)",
    )
    s.add_argument(
        "--disable-cuda-graph", action="store_true", help="run every decode step eagerly"
    )
    s.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="read each decode step back before queuing the next (overlap is on with CUDA)",
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=30.0,
        help="seconds a json_schema/regex/choice grammar may take to compile (default: 30)",
    )
    s.add_argument(
        "--disable-jump-forward",
        action="store_true",
        help="sample every token a grammar forces instead of appending it",
    )
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="largest request body, counted as it arrives (default: 16 MiB)",
    )
    s.add_argument(
        "--max-samples-per-request",
        type=int,
        default=128,
        help="most samples one request may ask for, n x prompts (default: 128, OpenAI's n limit)",
    )
    s.add_argument(
        "--allow-request-chat-template",
        action="store_true",
        help="accept a chat_template field in chat requests (rendered in a sandbox process with "
        "a time and size limit); refused by default",
    )
    s.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated browser origins allowed to call the server (CORS); by default "
        "cross-origin browser requests are refused",
    )
    s.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host names the server answers besides its own (a reverse "
        "proxy's public name; '*' for any); others get 403 (DNS rebinding)",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_S,
        help=f"seconds a client has to send a request's headers (default: {HEADER_TIMEOUT_S:g})",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        help=f"seconds a client has to send a request's body (default: {BODY_TIMEOUT_S:g})",
    )
    s.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=KEEP_ALIVE_S,
        help=f"seconds an idle keep-alive connection stays open (default: {KEEP_ALIVE_S:g})",
    )
    s.add_argument(
        "--health-timeout",
        type=float,
        default=120.0,
        help="/health fails when the scheduler is in one step this long (default: 120); it "
        "also fails after 5 s without the scheduler's heartbeat",
    )
    s.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="/health fails when the scheduler sends no heartbeat this long (default: 10)",
    )
    s.add_argument(
        "--max-session-pins",
        type=int,
        default=64,
        help="most program sessions kept pinned in the cache at once; the least recently used "
        "pin is released first (default: 64)",
    )
    s.add_argument(
        "--session-ttl",
        type=float,
        default=600.0,
        help="seconds a session pin lasts without a new request (default: 600)",
    )
    s.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    return ap


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, else --api-key-file, else $BRAID_API_KEY (ValueError if the
    file cannot be read or is empty)."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        try:
            key = open(args.api_key_file).read().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file: {args.api_key_file} is empty")
        return key
    return os.environ.get("BRAID_API_KEY") or None


def serve(args: argparse.Namespace) -> int:
    from braid.runtime.assets import ModelAssets
    from braid.runtime.config import EngineConfig
    from braid.runtime.server.app import ServerState, create_app
    from braid.runtime.server.http import run_server
    from braid.runtime.tokenizer.manager import TokenizerManager
    from braid.runtime.tokenizer.template_sandbox import TemplateSandbox

    level = args.log_level.upper()
    configure_logging(level)
    try:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            kv_tokens=args.max_total_tokens,
            mem_fraction_static=args.mem_fraction_static,
            page_size=args.page_size,
            max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            schedule_policy=args.schedule_policy,
            disable_radix_cache=args.disable_radix_cache,
            context_length=args.context_length,
            seed=args.seed,
            load_format=args.load_format,
            show_progress=False,
            grammar_compile_timeout_s=args.grammar_compile_timeout,
            disable_jump_forward=args.disable_jump_forward,
            attention_backend=args.attention_backend,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            disable_cuda_graph=args.disable_cuda_graph,
            overlap_schedule=False if args.disable_overlap_schedule else None,
            max_session_pins=args.max_session_pins,
            session_ttl_s=args.session_ttl,
        )
        assets = ModelAssets.load(args.model)
        api_key = _api_key(args)
        if args.max_samples_per_request < 1:
            raise ValueError("--max-samples-per-request must be at least 1")
    except ValueError as e:
        logger.error("braid serve: %s", e)
        return 2
    model_path, tokenizer = assets.path, assets.tokenizer
    if args.chat_template and tokenizer is not None:
        tpl = args.chat_template
        tokenizer.chat_template = open(tpl).read() if os.path.isfile(tpl) else tpl

    from braid.runtime.function_call import resolve_parser_name

    tool_call_parser = resolve_parser_name(
        args.tool_call_parser, tokenizer.chat_template if tokenizer is not None else None
    )
    logger.info("braid serve: tool-call parser: %s", tool_call_parser or "none")

    def on_failure(message: str) -> None:
        logger.error("braid serve: shutting down: %s", message)
        os.kill(os.getpid(), signal.SIGTERM)

    tm = TokenizerManager(
        config, model_path, assets.eos_token_ids, log_level=level, on_failure=on_failure
    )
    name = args.served_model_name or (args.model or "smollm2-135m")
    state = ServerState(
        tm=tm,
        tokenizer=tokenizer,
        served_model_name=name,
        model_path=str(model_path),
        defaults=assets.default_sampling_params(),
        api_key=api_key,
        max_body_bytes=args.max_request_bytes,
        server_args={k: v for k, v in vars(args).items() if not k.startswith("api_key")},
        tool_call_parser=tool_call_parser,
        strict_model_name=args.strict_model_name,
        bind_host=args.host,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        max_samples=args.max_samples_per_request,
        allow_request_chat_template=args.allow_request_chat_template,
        template_sandbox=TemplateSandbox(str(model_path))
        if args.allow_request_chat_template and tokenizer is not None
        else None,
        health_stuck_s=args.health_timeout,
        health_silent_s=args.heartbeat_timeout,
        allowed_hosts=tuple(h.strip().lower() for h in args.allowed_hosts.split(",") if h.strip()),
    )

    def on_ready() -> None:
        r = tm.ready
        logger.info(
            "braid serve: ready at http://%s:%d (model %s, %s %s, context %d, KV %d tokens)",
            args.host,
            args.port,
            name,
            r.device,
            r.dtype,
            r.context_length,
            r.kv_capacity_tokens,
        )

    app = create_app(state, on_ready=on_ready)
    try:
        run_server(
            app,
            args.host,
            args.port,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_s=args.keep_alive_timeout,
        )
    except Exception as e:  # start-up failures (model, port) end with one clear line
        logger.error("braid serve: %s", e)
        return 1
    if tm.failure:
        logger.error("braid serve: exited after a runtime failure: %s", tm.failure)
        return 1
    logger.info("braid serve: exit 0")
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        sys.exit(serve(args))


if __name__ == "__main__":
    main()
