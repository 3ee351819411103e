"""The controller's REST routes: parse -> call one controller function -> render.

Every /v1 endpoint needs TorchServe's management token (packrat.api.guard).
Loopback only by default (see packrat.commands.control).

    GET  /v1/models                          models and their live versions
    GET  /v1/models/{model}/status           version, plan, predicted and observed latency, last swaps
    POST /v1/models/{model}/plan             compute a plan for a batch (nothing applied)
    POST /v1/models/{model}/apply            apply a computed or an explicit plan, optionally in a given
                                             mode (synchronous swap); pins the model unless "pin": false
    PUT  /v1/models/{model}/pin              pin what is live now, or unpin: {"pinned": true|false}
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
    GET  /ui                                 the status page, read-only but for a model's pin (no
                                             token for the page itself; it asks for the key and
                                             calls /v1/... with it)

FastAPI's /docs and /redoc pages are off: they load their scripts from a CDN
(unreachable offline, and a third-party script in the operator's browser) and
are one more open path; docs/live-plans.md says so.

The routes are declared in groups, in the order the spec lists them.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from fastapi.params import Depends as DependsParam
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from packrat import jobs
from packrat.api.answers import (
    Health,
    render_adapt,
    render_error,
    render_health,
    render_metrics,
    render_model,
    render_pin,
    render_status,
    render_swap,
    render_tune,
)
from packrat.api.guard import TokenGate, token_dependency
from packrat.api.requests import (
    MAX_BODY_BYTES,
    AdaptRequest,
    ApplyRequest,
    Last,
    PinRequest,
    PlanRequest,
    ProfileRequest,
    TuneRequest,
    known_job,
    known_model,
    model_reading,
    reading_or_broken,
    replan_loop,
    requested_plan,
)
from packrat.api.spec import document_errors
from packrat.api.web import add_web_routes
from packrat.control import Controller
from packrat.errors import PackratError

Auth = list[DependsParam]


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
    app.add_exception_handler(PackratError, render_error)  # type: ignore[arg-type]
    auth = [Depends(token_dependency(controller))]
    _model_routes(app, controller, auth)
    _job_routes(app, controller, auth)
    _adapt_routes(app, controller, auth)
    _open_routes(app, controller)
    add_web_routes(app)
    document_errors(app)
    return app


def _model_routes(app: FastAPI, controller: Controller, auth: Auth) -> None:
    """One model's version, plan, swap, profile and tune."""

    @app.get("/v1/models", dependencies=auth, summary="Models and their live versions")
    def list_models() -> list[dict[str, Any]]:
        return [render_model(m, reading_or_broken(controller, m)) for m in controller.models()]

    # Each route reads the model once (model_reading) and passes that reading on. A status
    # (the page polls every model every 5 s) takes the tick's list of models while it is fresh.
    @app.get("/v1/models/{model}/status", dependencies=auth, summary="Live version, plan, latency and pin")
    def status(model: str) -> dict[str, Any]:
        return render_status(controller.status(model, st=model_reading(controller, model,
                                                                        controller.fresh_models())))

    @app.post("/v1/models/{model}/plan", dependencies=auth, summary="Compute a plan (not applied)")
    def plan(model: str, req: PlanRequest) -> dict[str, Any]:
        return controller.plan_for(model, req.batch, req.cores, st=model_reading(controller, model)).to_dict()

    @app.post("/v1/models/{model}/apply", dependencies=auth,
              summary="Apply a plan (in a given mode) by a version swap; pins the model unless pin is false")
    def apply(model: str, req: ApplyRequest) -> dict[str, Any]:
        st = model_reading(controller, model)
        the_plan = requested_plan(controller, st, req)
        record = controller.apply(model, the_plan, pin=req.pin, st=st)
        return render_swap(record, the_plan, controller.pins.get(model))

    @app.put("/v1/models/{model}/pin", dependencies=auth,
             summary="Pin what is live (the re-plan loop and the tuner leave it), or unpin")
    def put_pin(model: str, req: PinRequest) -> dict[str, Any]:
        st = model_reading(controller, model)
        if req.pinned:
            return render_pin(model, controller.pin(model, st=st))
        controller.unpin(model)
        return render_pin(model, None)

    # A profile or a tune runs in the background: 202 with the job to poll.
    @app.post("/v1/models/{model}/profile", dependencies=auth, status_code=202,
              summary="Re-profile in the background; poll the job")
    def profile(model: str, req: ProfileRequest | None = None) -> jobs.Job:
        req = req or ProfileRequest()  # no body: the defaults
        return controller.start_profile(model, max_batch=req.max_batch, budget_s=req.budget_s, cores=req.cores,
                                        st=model_reading(controller, model))

    @app.post("/v1/models/{model}/tune", dependencies=auth, status_code=202,
              summary="Tune in the background: guard and profile each mode, apply the best (mode, plan)")
    def tune(model: str, req: TuneRequest | None = None) -> jobs.Job:
        req = req or TuneRequest()  # no body: the defaults
        return controller.start_tune(model, modes=req.modes, budget_s=req.budget_s, batch=req.batch,
                                     fresh=req.fresh, max_batch=req.max_batch, point_budget_s=req.point_budget_s,
                                     st=model_reading(controller, model))

    @app.get("/v1/models/{model}/tune", dependencies=auth, summary="The running or last tune of a model")
    def get_tune(model: str) -> dict[str, Any]:
        return render_tune(model, controller.tune_status(known_model(controller, model)))


def _job_routes(app: FastAPI, controller: Controller, auth: Auth) -> None:
    """Background jobs, the swap history and the cores: across models."""

    @app.get("/v1/jobs", dependencies=auth, summary="Recent background jobs (profile, tune), oldest first")
    def list_jobs(model: str | None = None, last: Last = 20) -> list[jobs.Job]:
        return controller.jobs.recent(model, last)

    @app.get("/v1/jobs/{job_id}", dependencies=auth, summary="Poll a background job")
    def get_job(job_id: str) -> jobs.Job:
        return known_job(controller.jobs.get(job_id), job_id)

    @app.get("/v1/cores", dependencies=auth, summary="Usable cores (and why) and how they are divided among models")
    def cores() -> dict[str, Any]:
        return controller.cores_status()

    @app.get("/v1/swaps", dependencies=auth, summary="Swap history, newest last")
    def swaps(last: Last = 50) -> list[dict[str, Any]]:
        return controller.history(None, last=last)


def _adapt_routes(app: FastAPI, controller: Controller, auth: Auth) -> None:
    """The re-plan loop, per model."""

    @app.get("/v1/models/{model}/adapt", dependencies=auth, summary="Re-plan loop state and decisions")
    def get_adapt(model: str, last: Last = 20) -> dict[str, Any]:
        loop = replan_loop(controller, model)
        return render_adapt(model, loop.is_enabled(model), loop.decisions(model, last))

    @app.put("/v1/models/{model}/adapt", dependencies=auth, summary="Switch automatic re-planning on/off")
    def put_adapt(model: str, req: AdaptRequest) -> dict[str, Any]:
        loop = replan_loop(controller, model)
        controller.pins.set_adapt(model, req.enabled)  # a pin holds the loop off until it is unpinned
        return render_adapt(model, loop.is_enabled(model))


def _open_routes(app: FastAPI, controller: Controller) -> None:
    """Answered without the token (guard.OPEN_PATHS): counts and liveness, no secrets."""

    @app.get("/metrics", summary="Prometheus metrics of the controller and the re-plan loop (no token)",
             response_class=PlainTextResponse)
    def metrics() -> Response:
        # Unauthenticated like TorchServe's metrics port: counts only, and
        # Prometheus scrapers cannot follow a key that expires hourly.
        return render_metrics(controller.metrics_text())

    @app.get("/healthz", summary="Liveness (no token): 200 while the tick loop goes round and TorchServe "
             "answers it, 503 when not", response_model=Health,
             responses={503: {"model": Health, "description": "the tick loop is dead or stuck, or TorchServe's "
                                                              "management API did not answer its last tick"}})
    def healthz() -> JSONResponse:
        return render_health(*controller.health())
