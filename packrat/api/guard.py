"""The token: every /v1 call needs TorchServe's management key.

`Authorization: Bearer <management key from key_file.json>`, compared with the
key file as it is now, so a key TorchServe regenerates is honoured at once.
A key past its expiration time is refused (401 saying how to get a fresh one),
as TorchServe refuses it: the controller's own client mints a new one before
the old one expires (packrat.apply.client), so the file holds an expired key
only while TorchServe cannot rotate it (its token API down or refusing).

Guards, in this order, before any route runs: the token is checked by an ASGI
middleware (TokenGate) before the body is read (an unauthenticated caller
never gets its body parsed, and gets 401 whatever it sent); then FastAPI's
request body limit (requests.MAX_BODY_BYTES) answers 413 from the
Content-Length alone, or as soon as a chunked body passes the limit, without
reading the rest.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from packrat.api.web import WEB_PATHS
from packrat.control import Controller
from packrat.errors import TorchServeError

# Paths answered without the token (read-only, no secrets).
OPEN_PATHS = frozenset({"/metrics", "/openapi.json", "/healthz", *WEB_PATHS})
UNAUTHORISED = ("missing or wrong token: send Authorization: Bearer <management key from "
                "TorchServe's key_file.json>")
NO_KEY_FILE = "cannot read TorchServe's key file"
EXPIRED = ("the management key expired at {at} and TorchServe has not rotated it: `packrat torchserve keys "
           "management` mints a new one and prints it (or POST <management url>/token?type=management with the "
           "API key from key_file.json; or restart TorchServe), then send the new one")


def token_status(controller: Controller, authorization: str | None) -> tuple[int, str]:
    """(200, "") if `authorization` is "Bearer <TorchServe's management key as key_file.json holds it
    now>" and that key has not expired, (401, why) if not, (503, why) if the key file cannot be read."""
    try:
        keys = controller.client.keys()
    except TorchServeError:
        return 503, NO_KEY_FILE
    scheme, _, token = (authorization or "").partition(" ")
    if (
        keys is None
        or scheme.lower() != "bearer"
        or not hmac.compare_digest(token.strip().encode(), keys.management.key.encode())
    ):
        return 401, UNAUTHORISED
    if keys.management.expired():  # said only to a caller who holds the key
        return 401, EXPIRED.format(at=keys.management.expires)
    return 200, ""


class TokenGate:
    """ASGI middleware: check the token before anything reads the request body."""

    def __init__(self, app: ASGIApp, controller: Controller) -> None:
        self.app = app
        self.controller = controller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        # The key file is read (when it changed) off the event loop.
        code, detail = await run_in_threadpool(token_status, self.controller, header)
        if code == 200:
            await self.app(scope, receive, send)
            return
        headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
        # The body is never read.
        await JSONResponse({"detail": detail}, status_code=code, headers=headers)(scope, receive, send)


def token_dependency(controller: Controller) -> Callable[..., None]:
    """The routes' own check, declared as an HTTP bearer scheme so the spec documents it.

    TokenGate has already checked the token (before the body was read); this
    re-check is the route-level guarantee should a route ever be mounted outside the gate.
    """
    bearer = HTTPBearer(auto_error=False, description="TorchServe's management key (key_file.json)")

    def require_token(request: Request, _: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        code, detail = token_status(controller, request.headers.get("authorization"))
        if code == 503:
            raise HTTPException(503, detail)
        if code != 200:
            raise HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})

    return require_token
