"""The status page (GET /ui, docs/live-plans.md): static files from packrat/web/.

The page holds no data: it asks for the management key and calls /v1/... with
it. Its files are not API operations, so they stay out of the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
WEB_FILES = {"/ui": ("index.html", "text/html; charset=utf-8"),
             "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
             "/ui/style.css": ("style.css", "text/css; charset=utf-8")}
# The page's scripts come from this controller only, and call nothing else: no inline
# script, no third party, no framing (the management key is typed into it).
WEB_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
# "/ui/" (a typed trailing slash) redirects to "/ui": the page's links are relative to it.
WEB_PATHS = frozenset({*WEB_FILES, "/ui/"})


def _web_file(name: str, media_type: str) -> Callable[[], Response]:
    def serve() -> Response:
        return Response((WEB_DIR / name).read_bytes(), media_type=media_type, headers=WEB_HEADERS)
    return serve


def add_web_routes(app: FastAPI) -> None:
    for web_path, (name, media_type) in WEB_FILES.items():
        app.add_api_route(web_path, _web_file(name, media_type), methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui/", lambda: RedirectResponse("/ui", status_code=308), methods=["GET"],
                      include_in_schema=False)
