"""The playground: a chat page at `/` for trying the served model in a browser.

Static files shipped in the package (`static/`: one HTML page, one script, one stylesheet),
with no build step and nothing fetched from elsewhere, so the page works on a machine with no
internet. The page streams `/v1/chat/completions` like any client: a system prompt, sampling
controls, a JSON-schema toggle (`response_format`), and each reply's figures (tokens/s, time
to the first token, cached prompt tokens from `usage`).

The page and its assets are public (`PUBLIC_PATHS`: the API key guard lets them through, as
it does `/health`): they hold no data. The API calls the page makes carry the key its user
types into it. A Content-Security-Policy keeps the page to this server: no other origin's
script, style or connection.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

from braid.runtime.server.state import ServerState

STATIC = Path(__file__).with_name("static")
# URL path -> (file in STATIC, media type)
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/playground/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/playground/playground.css": ("playground.css", "text/css; charset=utf-8"),
}
PUBLIC_PATHS = frozenset(_FILES)
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
}


def add_routes(app: FastAPI, state: ServerState) -> None:
    for url, (name, media_type) in _FILES.items():
        app.add_api_route(
            url,
            _file_route(STATIC / name, media_type),
            methods=["GET"],
            include_in_schema=False,
            name=f"playground:{name}",
        )


def _file_route(path: Path, media_type: str):
    async def serve_file() -> FileResponse:
        return FileResponse(path, media_type=media_type, headers=_HEADERS)

    return serve_file
