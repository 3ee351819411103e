"""The OpenAPI document's error answers: which status each route may answer, and why.

The spec is FastAPI's (GET /openapi.json, exported to docs/openapi.json by
scripts/export_openapi.py). Clients (and tests/test_reliability_faults.py,
which fuzzes the API with schemathesis) check answers against it, so every
error status a route answers is listed here.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from packrat.api.requests import MAX_BATCH, MAX_BODY_BYTES, MAX_LAST, MAX_PROFILE_BUDGET_S

ERROR_DESCRIPTIONS = {
    400: "the request body cannot be decoded (not UTF-8 JSON text), or the request is not valid HTTP (a "
         "malformed header such as a Content-Length that is not a number: refused by the HTTP server "
         "before any route, on every route)",
    401: "missing or wrong token",
    404: "unknown model, job or profile",
    409: "busy (a swap, or a job of this kind, is running), the re-plan loop is not running, the model "
         "is pinned by an operator (unpin it first), or its live version's files are broken (the detail "
         "names the file)",
    413: f"request body over {MAX_BODY_BYTES} bytes",
    422: f"malformed request or plan, a value past its bound (the detail names the limit: batch <= {MAX_BATCH}, "
         f"threads <= the usable cores, profile budget_s <= {MAX_PROFILE_BUDGET_S:.0f}, last <= {MAX_LAST}), "
         "or a mode refused (not run here, or failed its accuracy guard)",
    500: "the swap failed and was rolled back (its record is in the body)",
    502: "TorchServe answered with an error, or did not answer",
    503: "TorchServe's key file cannot be read",
}
# 422 for a malformed body or parameter is FastAPI's own, documented with its schema
# wherever a route takes one (UNPROCESSABLE below).
ERROR_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("GET", "/v1/models"): (502,),
    ("GET", "/v1/models/{model}/status"): (404, 409, 502),
    ("POST", "/v1/models/{model}/plan"): (400, 404, 409, 413, 502),
    ("POST", "/v1/models/{model}/apply"): (400, 404, 409, 413, 500, 502),
    ("POST", "/v1/models/{model}/profile"): (400, 404, 409, 413, 502),
    ("GET", "/v1/jobs/{job_id}"): (404,),
    ("GET", "/v1/jobs"): (),
    ("GET", "/v1/swaps"): (),
    ("GET", "/v1/models/{model}/adapt"): (404, 409, 502),
    ("PUT", "/v1/models/{model}/adapt"): (400, 404, 409, 413, 502),
    ("PUT", "/v1/models/{model}/pin"): (400, 404, 409, 413, 502),
    ("POST", "/v1/models/{model}/tune"): (400, 404, 409, 413, 502),
    ("GET", "/v1/models/{model}/tune"): (404, 502),
}
# A route not listed above may answer any of them.
OTHER_ERRORS = (400, 404, 409, 413, 500, 502)

# A 422 is FastAPI's validation error (`detail`: a list of errors) or the controller's own
# (`detail`: a message, `error`: the exception's name): one schema for both.
UNPROCESSABLE: dict[str, Any] = {
    "description": ERROR_DESCRIPTIONS[422],
    "content": {"application/json": {"schema": {
        "type": "object",
        "required": ["detail"],
        "properties": {
            "detail": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
            "error": {"type": "string"},
        },
    }}},
}


def document_errors(app: FastAPI) -> None:
    """Put each /v1 route's error statuses into the spec (401 and 503: the token gate's; 400 on
    every route too: the HTTP server refuses a request that is not valid HTTP before any route)."""
    from fastapi.dependencies.utils import get_flat_params
    from fastapi.routing import APIRoute

    for route in app.routes:
        if not isinstance(route, APIRoute) or not route.path.startswith("/v1/"):
            continue
        for method in route.methods:
            for code in (400, 401, 503, *ERROR_STATUSES.get((method, route.path), OTHER_ERRORS)):
                route.responses.setdefault(code, {"description": ERROR_DESCRIPTIONS[code]})
        if route.body_field is not None or get_flat_params(route.dependant):
            route.responses[422] = UNPROCESSABLE  # where FastAPI would document its own
