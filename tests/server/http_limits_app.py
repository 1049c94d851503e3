"""A tiny app served by `run_server`, for test_http_limits.py:
`python -m tests.server.http_limits_app --port N [limits] [--fail-startup]`.

Prints "stopped" when `run_server` returns, and "start-up failed: ..." (exit status 1) when it
raises ServerStartError, as `braid serve` does."""

from __future__ import annotations

import argparse
import asyncio
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response

from braid.runtime.server.http import ServerStartError, run_server


def create_app(fail_startup: bool = False) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if fail_startup:
            raise RuntimeError("weights not found")
        yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        return Response(await request.body(), media_type="application/octet-stream")

    @app.get("/sleep")
    async def sleep(s: float) -> dict:
        await asyncio.sleep(s)
        return {"slept": s}

    return app


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--header-timeout", type=float, default=10.0)
    ap.add_argument("--body-timeout", type=float, default=30.0)
    ap.add_argument("--keep-alive", type=float, default=5.0)
    ap.add_argument("--max-header-bytes", type=int, default=16384)
    ap.add_argument("--fail-startup", action="store_true")
    args = ap.parse_args()
    try:
        run_server(
            create_app(args.fail_startup),
            "127.0.0.1",
            args.port,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_s=args.keep_alive,
            max_header_bytes=args.max_header_bytes,
            graceful_s=2.0,
        )
    except ServerStartError as e:
        print(f"start-up failed: {e}", file=sys.stderr, flush=True)
        return 1
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
