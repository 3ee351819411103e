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
    GET  /v1/jobs/{job_id}                   poll a job
    GET  /v1/swaps                           swap history (all models)
    GET  /v1/models/{model}/adapt            the re-plan loop: enabled, recent decisions
    PUT  /v1/models/{model}/adapt            switch the re-plan loop on/off for a model
    GET  /metrics                            Prometheus text: the loop's counters (no token,
                                             like TorchServe's own metrics port)

The spec is FastAPI's (GET /openapi.json, exported to docs/openapi.json by
scripts/export_openapi.py).
"""

from __future__ import annotations

import hmac
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

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


def create_app(controller: Controller) -> FastAPI:
    app = FastAPI(
        title="Packrat controller",
        version="1",
        description=(
            "Live plans for TorchServe: thin pinned workers, active-passive swaps. "
            "Every call needs `Authorization: Bearer <TorchServe management key>`."
        ),
    )

    # Declared as an HTTP bearer scheme so the OpenAPI spec documents it; checked by hand
    # (auto_error=False) so every failure is the same 401 with a useful message.
    bearer = HTTPBearer(auto_error=False, description="TorchServe's management key (key_file.json)")

    def require_token(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        try:
            expected = controller.management_key()
        except TorchServeError as exc:
            raise HTTPException(503, f"cannot read TorchServe's key file: {exc}") from exc
        if (
            creds is None
            or expected is None
            or not hmac.compare_digest(creds.credentials.strip().encode(), expected.encode())
        ):
            raise HTTPException(
                401,
                "missing or wrong token: send Authorization: Bearer <management key from TorchServe's key_file.json>",
                headers={"WWW-Authenticate": "Bearer"},
            )

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
    def profile(model: str, req: ProfileRequest) -> jobs.Job:
        known(model)
        return controller.start_profile(model, max_batch=req.max_batch, budget_s=req.budget_s, cores=req.cores)

    @app.get("/v1/jobs/{job_id}", dependencies=auth, summary="Poll a background job")
    def get_job(job_id: str) -> jobs.Job:
        job = controller.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return job

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

    @app.get("/metrics", summary="Prometheus metrics of the re-plan loop (no token)")
    def metrics() -> Response:
        # Unauthenticated like TorchServe's metrics port: counts only, and
        # Prometheus scrapers cannot follow a key that expires hourly.
        from prometheus_client import CONTENT_TYPE_LATEST

        body = controller.policy.metrics_text() if controller and controller.policy else b""
        return Response(content=body, media_type=CONTENT_TYPE_LATEST)

    return app


def export_openapi(path: str | Path) -> None:
    """Write the OpenAPI spec without a running TorchServe (the routes do not call it)."""
    import json

    app = create_app(None)  # type: ignore[arg-type]
    Path(path).write_text(json.dumps(app.openapi(), indent=2) + "\n")
