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
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from packrat.apply import versions
from packrat.control import Controller
from packrat.errors import (
    ConfigError,
    PackratError,
    PlanError,
    ProfileError,
    SwapError,
    TorchServeError,
)
from packrat.types import Instance, Plan

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


class Job(BaseModel):
    id: str
    kind: str
    model: str
    state: str  # queued | running | done | failed
    created: float
    finished: float | None = None
    result: dict[str, Any] | None = None
    error: str | None = None


def _plan_out(plan: Plan) -> dict[str, Any]:
    out = versions.plan_to_dict(plan)
    out["realizable"] = plan.realizable
    out["threads_used"] = plan.threads_used
    return out


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
    jobs: dict[str, Job] = {}
    jobs_lock = threading.Lock()

    # Declared as an HTTP bearer scheme so the OpenAPI spec documents it; checked by hand
    # (auto_error=False) so every failure is the same 401 with a useful message.
    bearer = HTTPBearer(auto_error=False, description="TorchServe's management key (key_file.json)")

    def require_token(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        try:
            keys = controller.client.keys()
        except TorchServeError as exc:
            raise HTTPException(503, f"cannot read TorchServe's key file: {exc}") from exc
        expected = keys.management.key if keys else None
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
        # Where each error leaf lands: the caller's fault is 4xx, TorchServe's or the swap's 5xx.
        if isinstance(exc, TorchServeError):
            code = 404 if exc.status == 404 else 502
        elif isinstance(exc, (ConfigError, PlanError)):
            code = 422
        elif isinstance(exc, ProfileError):
            code = 404
        elif isinstance(exc, SwapError):
            code = 500
        else:
            code = 500
        body: dict[str, Any] = {"detail": str(exc), "error": type(exc).__name__}
        record = getattr(exc, "record", None)
        if record is not None:
            body["swap"] = record.to_dict()
        return JSONResponse(status_code=code, content=body)

    def known(model: str) -> None:
        if model not in controller.models():
            raise HTTPException(404, f"unknown model {model!r}; registered: {controller.models()}")

    def load_profile(model: str):
        from packrat.plan import load_profile as _load

        path = controller.profile_path(model)
        if not path.exists():
            raise HTTPException(
                404,
                f"no profile for {model!r} at {path}: POST /v1/models/{model}/profile first "
                "(or place a `packrat profile` output there)",
            )
        return _load(path)

    def compute(model: str, batch: int, cores: int | None) -> Plan:
        from packrat.plan import realizable_plan

        ncores = cores or len(controller.cores)
        if ncores > len(controller.cores):
            raise ConfigError(f"cores {ncores} exceeds the {len(controller.cores)} usable cores")
        return realizable_plan(load_profile(model), ncores, batch)

    @app.get("/v1/models", dependencies=auth, summary="Models and their live versions")
    def list_models() -> list[dict[str, Any]]:
        out = []
        for m in controller.models():
            st = controller.model_state(m)
            out.append({"model": m, "version": st.version, "plan": _plan_out(st.plan) if st.plan else None})
        return out

    @app.get("/v1/models/{model}/status", dependencies=auth, summary="Live version, plan and latency")
    def status(model: str) -> dict[str, Any]:
        known(model)
        return controller.status(model)

    @app.post("/v1/models/{model}/plan", dependencies=auth, summary="Compute a plan (not applied)")
    def plan(model: str, req: PlanRequest) -> dict[str, Any]:
        known(model)
        return _plan_out(compute(model, req.batch, req.cores))

    @app.post("/v1/models/{model}/apply", dependencies=auth, summary="Apply a plan by a version swap")
    def apply(model: str, req: ApplyRequest) -> dict[str, Any]:
        known(model)
        if (req.batch is None) == (req.instances is None):
            raise HTTPException(422, "give exactly one of `batch` (computed plan) or `instances` (explicit plan)")
        if req.instances is not None:
            inst = tuple(Instance(i.threads, i.batch, 0.0) for i in req.instances)
            if len({i.batch for i in inst}) > 1:
                raise HTTPException(422, "all instances of a plan share one batch cap in TorchServe")
            predicted = 0.0
            try:
                from packrat.plan import load_profile as _load

                path = controller.profile_path(model)
                if path.exists():
                    prof = _load(path)
                    lat = [prof.latency(i.threads, i.batch) for i in inst]
                    if all(x is not None for x in lat):
                        inst = tuple(Instance(i.threads, i.batch, float(x)) for i, x in zip(inst, lat))
                        predicted = max(float(x) for x in lat)  # type: ignore[arg-type]
            except ProfileError:
                pass  # explicit plans need no profile; they just have no prediction
            the_plan = Plan(
                cores=len(controller.cores),
                batch=sum(i.batch for i in inst),
                instances=tuple(sorted(inst, key=lambda i: (-i.threads, -i.batch))),
                predicted_latency_ms=predicted,
            )
        else:
            assert req.batch is not None
            the_plan = compute(model, req.batch, None)
        if controller.swap_busy():
            raise HTTPException(409, "a swap is already running; try again when it is done")
        record = controller.apply(model, the_plan)
        return {"swap": record.to_dict(), "plan": _plan_out(the_plan)}

    @app.post(
        "/v1/models/{model}/profile",
        dependencies=auth,
        status_code=202,
        summary="Re-profile in the background; poll the job",
    )
    def profile(model: str, req: ProfileRequest) -> Job:
        known(model)
        try:
            from packrat.profile.identity import open_archive
            from packrat.profile.runner import ProfileSettings, run_profile
            from packrat.profile.store import save_profile
        except ImportError as exc:  # the profiler is another stage; say so instead of failing obscurely
            raise HTTPException(501, f"profiling is not available in this build: {exc}") from exc
        st = controller.model_state(model)
        base_dir = controller.settings.model_store / controller.swapper.base_of(st.url)
        settings = ProfileSettings(
            cores=req.cores or len(controller.cores), max_batch=req.max_batch, budget_s=req.budget_s
        )
        try:
            settings.validate(len(controller.cores))
            archive = open_archive(base_dir)
        except ConfigError as exc:
            raise HTTPException(422, str(exc)) from exc
        job = Job(id=uuid.uuid4().hex[:12], kind="profile", model=model, state="queued", created=time.time())
        with jobs_lock:
            if any(j.state in ("queued", "running") and j.kind == "profile" for j in jobs.values()):
                raise HTTPException(409, "a profiling job is already running")
            jobs[job.id] = job

        def run() -> None:
            job.state = "running"
            out = controller.profile_path(model)
            try:
                prof = run_profile(archive, settings, progress=False)
                save_profile(prof, out)
                job.result = {"profile_path": str(out), "points": len(prof.points)}
                job.state = "done"
            except Exception as exc:  # reported through the job, not swallowed
                job.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
                job.state = "failed"
            finally:
                job.finished = time.time()

        threading.Thread(target=run, name=f"profile-{job.id}", daemon=True).start()
        return job

    @app.get("/v1/jobs/{job_id}", dependencies=auth, summary="Poll a background job")
    def get_job(job_id: str) -> Job:
        job = jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return job

    @app.get("/v1/swaps", dependencies=auth, summary="Swap history, newest last")
    def swaps(last: int = 50) -> list[dict[str, Any]]:
        return controller.history(None, last=last)

    def adaptive(model: str):
        known(model)
        loop = controller.policy
        if loop is None or not hasattr(loop, "set_enabled"):
            raise HTTPException(409, "the re-plan loop is not running in this controller")
        return loop

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
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        registry = getattr(controller.policy, "registry", None) if controller else None
        body = generate_latest(registry) if registry is not None else b""
        return Response(content=body, media_type=CONTENT_TYPE_LATEST)

    return app


def export_openapi(path: str | Path) -> None:
    """Write the OpenAPI spec without a running TorchServe (the routes do not call it)."""
    import json

    app = create_app(None)  # type: ignore[arg-type]
    Path(path).write_text(json.dumps(app.openapi(), indent=2) + "\n")
