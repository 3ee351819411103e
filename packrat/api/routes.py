"""The controller's REST API: parse -> call one controller function -> render.

Every endpoint needs TorchServe's management token (`Authorization: Bearer
<management key from key_file.json>`), compared with the key file as it is
now, so a key TorchServe regenerates is honoured at once. Loopback only by
default (see packrat.commands.control).

    GET  /v1/models                          models and their live versions
    GET  /v1/models/{model}/status           version, plan, predicted and observed latency, last swaps
    POST /v1/models/{model}/plan             compute a plan for a batch (nothing applied)
    POST /v1/models/{model}/apply            apply a computed or an explicit plan (synchronous swap)
    POST /v1/models/{model}/profile          re-profile in the background -> job
    POST /v1/models/{model}/tune             tune: guard + profile each mode, apply the best
                                             (mode, plan) -> job (optional body; docs/tuning.md)
    GET  /v1/models/{model}/tune             the running or last tune: stage, modes, choice
    GET  /v1/jobs                            recent jobs (profile, tune), optionally of one model
    GET  /v1/jobs/{job_id}                   poll a job
    GET  /v1/swaps                           swap history (all models)
    GET  /v1/cores                           usable cores (and why), and how they are divided among models
    GET  /v1/models/{model}/adapt            the re-plan loop: enabled, recent decisions
    PUT  /v1/models/{model}/adapt            switch the re-plan loop on/off for a model
    GET  /metrics                            Prometheus text: the controller's and the loop's
                                             counters (no token, like TorchServe's own metrics port)
    GET  /openapi.json                       the spec (no token; the same as docs/openapi.json)
    GET  /healthz                            200 while the tick loop goes round and TorchServe
                                             answers it, else 503 (no token: the liveness probe)
    GET  /ui                                 the read-only status page (no token for the page
                                             itself; it asks for the key and calls /v1/... with it)

The spec is FastAPI's (GET /openapi.json, exported to docs/openapi.json by
scripts/export_openapi.py). FastAPI's /docs and /redoc pages are off: they load
their scripts from a CDN (unreachable offline, and a third-party script in the
operator's browser) and are one more open path; docs/live-plans.md says so.

Guards, in this order, before any route runs: the token is checked by an ASGI
middleware before the body is read (an unauthenticated caller never gets its
body parsed, and gets 401 whatever it sent); then FastAPI's request body limit
(MAX_BODY_BYTES) answers 413 from the Content-Length alone, or as soon as a
chunked body passes the limit, without reading the rest.
"""

from __future__ import annotations

import hmac
from dataclasses import asdict
from pathlib import Path
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from packrat.control import Controller, ModelStatus, WorkerState
from packrat.errors import (
    BusyError,
    ConfigError,
    PackratError,
    PlanError,
    ProfileError,
    SwapError,
    TorchServeError,
)
from packrat import jobs
from packrat.types import Plan, Policy

# The largest request body accepted: an explicit plan of a few hundred instances
# is a few kB; anything near this is not a request to this API.
MAX_BODY_BYTES = 64 * 1024
# The status page's files (static, no data in them): packrat/web/.
WEB_DIR = Path(__file__).resolve().parent / "web"
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
# Paths answered without the token (read-only, no secrets).
# "/ui/" (a typed trailing slash) redirects to "/ui": the page's links are relative to it.
OPEN_PATHS = frozenset({"/metrics", "/openapi.json", "/healthz", "/ui/", *WEB_FILES})
UNAUTHORISED = ("missing or wrong token: send Authorization: Bearer <management key from "
                "TorchServe's key_file.json>")

# Every error status a route answers, for the spec: clients (and tests/test_reliability_faults.py,
# which fuzzes the API with schemathesis) check answers against it. 422 for a malformed
# body or parameter is FastAPI's own, documented with its schema wherever a route takes one.
ERROR_DESCRIPTIONS = {
    400: "the request body cannot be decoded (not UTF-8 JSON text)",
    401: "missing or wrong token",
    404: "unknown model, job or profile",
    409: "busy (a swap, or a job of this kind, is running) or the re-plan loop is not running",
    413: f"request body over {MAX_BODY_BYTES} bytes",
    422: "malformed request or plan",
    500: "the swap failed and was rolled back (its record is in the body)",
    502: "TorchServe answered with an error, or did not answer",
    503: "TorchServe's key file cannot be read",
}
ERROR_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("GET", "/v1/models"): (502,),
    ("GET", "/v1/models/{model}/status"): (404, 502),
    ("POST", "/v1/models/{model}/plan"): (400, 404, 413, 502),
    ("POST", "/v1/models/{model}/apply"): (400, 404, 409, 413, 500, 502),
    ("POST", "/v1/models/{model}/profile"): (400, 404, 409, 413, 502),
    ("GET", "/v1/jobs/{job_id}"): (404,),
    ("GET", "/v1/jobs"): (),
    ("GET", "/v1/swaps"): (),
    ("GET", "/v1/models/{model}/adapt"): (404, 409, 502),
    ("PUT", "/v1/models/{model}/adapt"): (400, 404, 409, 413, 502),
    ("POST", "/v1/models/{model}/tune"): (400, 404, 409, 413, 502),
    ("GET", "/v1/models/{model}/tune"): (404, 502),
}
# A route not listed above may answer any of them.
OTHER_ERRORS = (400, 404, 409, 413, 500, 502)

# -- request / response bodies ----------------------------------------------------


class InstanceIn(BaseModel):
    threads: int = Field(ge=1, description="intra-op threads = cores of this worker")
    batch: int = Field(ge=1, description="batch cap; every instance of one plan must share it")


class PlanRequest(BaseModel):
    batch: int = Field(ge=1, description="load batch B (concurrent requests) to plan for")
    cores: int | None = Field(default=None, ge=1, description="cores to plan on [default: all usable]")


class ApplyRequest(BaseModel):
    """Either `batch` (a plan is computed from the model's profile) or explicit `instances`."""

    batch: int | None = Field(default=None, ge=1)
    instances: list[InstanceIn] | None = Field(default=None, min_length=1)


class ProfileRequest(BaseModel):
    max_batch: int = Field(default=8, ge=1, le=1024)
    budget_s: float | None = Field(default=120.0, gt=0, description="whole profiling run [s]")
    cores: int | None = Field(default=None, ge=1)


class TuneRequest(BaseModel):
    """Every field optional; no body at all means the defaults."""

    modes: list[str] | None = Field(
        default=None, max_length=32,
        description="modes to try besides the archive's own, e.g. ['bf16-openvino']; ['all'] = every "
                    "supported mode [default: a short list per task, docs/tuning.md]")
    budget_s: float | None = Field(default=None, gt=0, le=24 * 3600,
                                   description="the whole tune of this model [s] (default 180)")
    batch: int | None = Field(default=None, ge=1, le=1024,
                              description="load batch B to choose for [default: observed, else 8]")
    fresh: bool = Field(default=False, description="re-profile modes whose profile is still valid")
    max_batch: int | None = Field(default=None, ge=1, le=1024,
                                  description="largest profiled batch [default: max(batch, 8)]")
    point_budget_s: float | None = Field(default=None, gt=0, le=600,
                                         description="seconds per profiled point [default 5]")


class Health(BaseModel):
    """GET /healthz: from what the tick loop last saw (TorchServe is not called by the probe)."""

    status: str = Field(description="ok | unhealthy")
    problems: list[str] = Field(description="why unhealthy; empty when ok")
    tick_age_s: float | None = Field(description="seconds since the tick loop last went round")
    tick_stale_after_s: float = Field(description="unhealthy when tick_age_s exceeds this")
    torchserve_reachable: bool = Field(description="TorchServe's management API answered the last tick")
    swap_running: bool


class AdaptRequest(BaseModel):
    enabled: bool = Field(description="false: keep the current plan fixed (no automatic re-plan)")


# -- rendering the controller's typed answers --------------------------------------


def render_worker(w: WorkerState) -> dict[str, Any]:
    if w.check is None:
        return dict(w.described)
    c = w.check
    return {
        **w.described,
        "slot": c.slot,
        "cores": list(c.cores) if c.cores is not None else None,
        "affinity": list(c.affinity) if c.affinity is not None else None,
        "torch_threads": c.torch_threads,
        "as_planned": c.ok,
    }


def render_status(s: ModelStatus) -> dict[str, Any]:
    st = s.state
    return {
        "model": st.model,
        "version": st.version,
        "url": st.url,
        "plan": st.plan.to_dict() if st.plan else None,
        # 0 means "not predicted" (an explicit plan applied without a profile).
        "predicted_latency_ms": (st.plan.predicted_latency_ms or None) if st.plan else None,
        "observed": asdict(s.observed) if s.observed else None,
        "workers": [render_worker(w) for w in st.workers],
        "other_versions": list(st.other_versions),
        "swap_in_progress": s.swap_in_progress.to_dict() if s.swap_in_progress else None,
        "last_swaps": list(s.last_swaps),
        "adapt": s.adapt,
        "mode": st.mode,
        "tune": s.tune,
        # Cores among models: where the live workers pin, and the cores the model has now.
        "cores": list(st.cores) if st.cores is not None else None,
        "share": list(s.share) if s.share is not None else None,
    }


def error_status(exc: PackratError) -> int:
    """Where each error leaf lands: the caller's fault is 4xx, TorchServe's or the swap's 5xx."""
    if isinstance(exc, TorchServeError):
        return 404 if exc.status == 404 else 502
    if isinstance(exc, (ConfigError, PlanError)):
        return 422
    if isinstance(exc, ProfileError):
        return 404
    if isinstance(exc, BusyError):
        return 409
    return 500  # SwapError and anything else


# -- the app ---------------------------------------------------------------------


def token_status(controller: Controller, authorization: str | None) -> int:
    """200 if `authorization` is "Bearer <TorchServe's management key as key_file.json holds it now>",
    401 if not, 503 if the key file cannot be read."""
    try:
        expected = controller.management_key()
    except TorchServeError:
        return 503
    scheme, _, token = (authorization or "").partition(" ")
    if (
        expected is None
        or scheme.lower() != "bearer"
        or not hmac.compare_digest(token.strip().encode(), expected.encode())
    ):
        return 401
    return 200


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
        code = await run_in_threadpool(token_status, self.controller, header)
        if code == 200:
            await self.app(scope, receive, send)
            return
        detail = UNAUTHORISED if code == 401 else "cannot read TorchServe's key file"
        headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
        # The body is never read.
        await JSONResponse({"detail": detail}, status_code=code, headers=headers)(scope, receive, send)


def create_app(controller: Controller) -> FastAPI:
    app = FastAPI(
        title="Packrat controller",
        version="1",
        description=(
            "Live plans for TorchServe: thin pinned workers, active-passive swaps. "
            "Every call needs `Authorization: Bearer <TorchServe management key>`. "
            f"Request bodies over {MAX_BODY_BYTES} bytes get 413."
        ),
        docs_url=None,
        redoc_url=None,
        max_body_size=MAX_BODY_BYTES,
    )
    app.add_middleware(TokenGate, controller=controller)

    # Declared as an HTTP bearer scheme so the OpenAPI spec documents it. TokenGate has
    # already checked the token (before the body was read); this re-check is the
    # route-level guarantee should a route ever be mounted outside the gate.
    bearer = HTTPBearer(auto_error=False, description="TorchServe's management key (key_file.json)")

    def require_token(request: Request, _: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        code = token_status(controller, request.headers.get("authorization"))
        if code == 503:
            raise HTTPException(503, "cannot read TorchServe's key file")
        if code != 200:
            raise HTTPException(401, UNAUTHORISED, headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(require_token)]

    @app.exception_handler(PackratError)
    async def packrat_error(_: Request, exc: PackratError) -> JSONResponse:
        body: dict[str, Any] = {"detail": str(exc), "error": type(exc).__name__}
        if isinstance(exc, SwapError) and exc.record is not None:
            body["swap"] = exc.record.to_dict()
        return JSONResponse(status_code=error_status(exc), content=body)

    def known(model: str) -> None:
        models = controller.models()
        if model not in models:
            raise HTTPException(404, f"unknown model {model!r}; registered: {models}")

    def adaptive(model: str) -> Policy:
        known(model)
        if controller.policy is None:
            raise HTTPException(409, "the re-plan loop is not running in this controller")
        return controller.policy

    @app.get("/v1/models", dependencies=auth, summary="Models and their live versions")
    def list_models() -> list[dict[str, Any]]:
        out = []
        for m in controller.models():
            st = controller.model_state(m)
            out.append({"model": m, "version": st.version, "plan": st.plan.to_dict() if st.plan else None})
        return out

    @app.get("/v1/models/{model}/status", dependencies=auth, summary="Live version, plan and latency")
    def status(model: str) -> dict[str, Any]:
        known(model)
        return render_status(controller.status(model))

    @app.post("/v1/models/{model}/plan", dependencies=auth, summary="Compute a plan (not applied)")
    def plan(model: str, req: PlanRequest) -> dict[str, Any]:
        known(model)
        return controller.plan_for(model, req.batch, req.cores).to_dict()

    @app.post("/v1/models/{model}/apply", dependencies=auth, summary="Apply a plan by a version swap")
    def apply(model: str, req: ApplyRequest) -> dict[str, Any]:
        known(model)
        if (req.batch is None) == (req.instances is None):
            raise HTTPException(422, "give exactly one of `batch` (computed plan) or `instances` (explicit plan)")
        the_plan: Plan
        if req.instances is not None:
            the_plan = controller.explicit_plan(model, [(i.threads, i.batch) for i in req.instances])
        else:
            assert req.batch is not None
            the_plan = controller.plan_for(model, req.batch)
        record = controller.apply(model, the_plan)
        return {"swap": record.to_dict(), "plan": the_plan.to_dict()}

    @app.post(
        "/v1/models/{model}/profile",
        dependencies=auth,
        status_code=202,
        summary="Re-profile in the background; poll the job",
    )
    def profile(model: str, req: ProfileRequest | None = None) -> jobs.Job:
        known(model)
        req = req or ProfileRequest()  # no body: the defaults
        return controller.start_profile(model, max_batch=req.max_batch, budget_s=req.budget_s, cores=req.cores)

    @app.post(
        "/v1/models/{model}/tune",
        dependencies=auth,
        status_code=202,
        summary="Tune in the background: guard and profile each mode, apply the best (mode, plan)",
    )
    def tune(model: str, req: TuneRequest | None = None) -> jobs.Job:
        known(model)
        req = req or TuneRequest()  # no body: the defaults
        return controller.start_tune(model, modes=req.modes, budget_s=req.budget_s, batch=req.batch,
                                     fresh=req.fresh, max_batch=req.max_batch,
                                     point_budget_s=req.point_budget_s)

    @app.get("/v1/models/{model}/tune", dependencies=auth, summary="The running or last tune of a model")
    def get_tune(model: str) -> dict[str, Any]:
        known(model)
        return {"model": model, "tune": controller.tune_status(model)}

    @app.get("/v1/jobs", dependencies=auth, summary="Recent background jobs (profile, tune), oldest first")
    def list_jobs(model: str | None = None, last: int = Query(default=20, ge=1, le=1000)) -> list[jobs.Job]:
        return controller.jobs.recent(model, last)

    @app.get("/v1/jobs/{job_id}", dependencies=auth, summary="Poll a background job")
    def get_job(job_id: str) -> jobs.Job:
        job = controller.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return job

    @app.get("/v1/cores", dependencies=auth, summary="Usable cores (and why) and how they are divided among models")
    def cores() -> dict[str, Any]:
        return controller.cores_status()

    @app.get("/v1/swaps", dependencies=auth, summary="Swap history, newest last")
    def swaps(last: int = 50) -> list[dict[str, Any]]:
        return controller.history(None, last=last)

    @app.get("/v1/models/{model}/adapt", dependencies=auth, summary="Re-plan loop state and decisions")
    def get_adapt(model: str, last: int = 20) -> dict[str, Any]:
        loop = adaptive(model)
        return {"model": model, "enabled": loop.is_enabled(model), "decisions": loop.decisions(model, last)}

    @app.put("/v1/models/{model}/adapt", dependencies=auth, summary="Switch automatic re-planning on/off")
    def put_adapt(model: str, req: AdaptRequest) -> dict[str, Any]:
        loop = adaptive(model)
        loop.set_enabled(model, req.enabled)
        return {"model": model, "enabled": loop.is_enabled(model)}

    @app.get("/metrics", summary="Prometheus metrics of the controller and the re-plan loop (no token)",
             response_class=PlainTextResponse)
    def metrics() -> Response:
        # Unauthenticated like TorchServe's metrics port: counts only, and
        # Prometheus scrapers cannot follow a key that expires hourly.
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(content=controller.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", summary="Liveness (no token): 200 while the tick loop goes round and TorchServe "
             "answers it, 503 when not", response_model=Health,
             responses={503: {"model": Health, "description": "the tick loop is dead or stuck, or TorchServe's "
                                                              "management API did not answer its last tick"}})
    def healthz() -> JSONResponse:
        healthy, body = controller.health()
        return JSONResponse(Health(**body).model_dump(), status_code=200 if healthy else 503)

    def web_file(name: str, media_type: str) -> Callable[[], Response]:
        def serve() -> Response:
            return Response((WEB_DIR / name).read_bytes(), media_type=media_type, headers=WEB_HEADERS)
        return serve

    # The status page (docs/live-plans.md): static files; the data comes from /v1/... with
    # the key the user types in. Not API operations, so not in the spec.
    for web_path, (name, media_type) in WEB_FILES.items():
        app.add_api_route(web_path, web_file(name, media_type), methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui/", lambda: RedirectResponse("/ui", status_code=308), methods=["GET"],
                      include_in_schema=False)

    document_errors(app)
    return app


# A 422 is FastAPI's validation error (`detail`: a list of errors) or the controller's own
# (`detail`: a message, `error`: the exception's name): one schema for both.
UNPROCESSABLE = {
    "description": "malformed request or plan",
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
    """Put each /v1 route's error statuses into the spec (401 and 503: the token gate's)."""
    from fastapi.dependencies.utils import get_flat_params
    from fastapi.routing import APIRoute

    for route in app.routes:
        if not isinstance(route, APIRoute) or not route.path.startswith("/v1/"):
            continue
        for method in route.methods:
            for code in (401, 503, *ERROR_STATUSES.get((method, route.path), OTHER_ERRORS)):
                route.responses.setdefault(code, {"description": ERROR_DESCRIPTIONS[code]})
        if route.body_field is not None or get_flat_params(route.dependant):
            route.responses[422] = UNPROCESSABLE  # where FastAPI would document its own


def export_openapi(path: str | Path) -> None:
    """Write the OpenAPI spec without a running TorchServe (the routes do not call it)."""
    import json

    app = create_app(None)  # type: ignore[arg-type]
    Path(path).write_text(json.dumps(app.openapi(), indent=2) + "\n")
