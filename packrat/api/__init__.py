"""The controller's REST API (FastAPI), one job per module:

    routes    the endpoints: parse -> call one controller function -> render
    requests  what a request may carry (bodies, limits) and its checks
    answers   the controller's typed values as JSON bodies; errors -> statuses
    guard     the token check, before any body is read
    spec      the OpenAPI document's error answers
    web       the status page's static files (GET /ui)
    server    uvicorn, its housekeeping woken once a second (QuietServer)
"""

from __future__ import annotations

import json
from pathlib import Path

from packrat.api.requests import MAX_BODY_BYTES
from packrat.api.routes import create_app

__all__ = ["MAX_BODY_BYTES", "create_app", "export_openapi"]


def export_openapi(path: str | Path) -> None:
    """Write the OpenAPI spec without a running TorchServe (the routes do not call it)."""
    app = create_app(None)  # type: ignore[arg-type]
    Path(path).write_text(json.dumps(app.openapi(), indent=2) + "\n")
