"""What the API answers: the controller's typed values rendered as JSON bodies.

Also where each PackratError lands (its HTTP status and body): the caller's
fault is 4xx, TorchServe's or the swap's 5xx.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from packrat.control import ModelState, ModelStatus, WorkerState
from packrat.errors import (
    BusyError,
    ConfigError,
    ModeRefusedError,
    PackratError,
    PlanError,
    ProfileError,
    SwapError,
    TorchServeError,
)
from packrat.types import Plan, SwapRecord


class Health(BaseModel):
    """GET /healthz: from what the tick loop last saw (TorchServe is not called by the probe)."""

    status: str = Field(description="ok | unhealthy")
    problems: list[str] = Field(description="why unhealthy; empty when ok")
    tick_age_s: float | None = Field(description="seconds since the tick loop last went round")
    tick_stale_after_s: float = Field(description="unhealthy when tick_age_s exceeds this")
    torchserve_reachable: bool = Field(description="TorchServe's management API answered the last tick")
    swap_running: bool


def render_model(model: str, st: ModelState | str) -> dict[str, Any]:
    """One row of GET /v1/models; `st` a str: why the model cannot be read (its files are broken)."""
    if isinstance(st, str):
        return {"model": model, "version": None, "plan": None, "broken": st}
    return {"model": model, "version": st.version, "plan": st.plan.to_dict() if st.plan else None}


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
        # The request sizes that prediction is for ({"tokens": 5}; None: not known).
        "predicted_for": dict(st.plan.sizes) if st.plan and st.plan.sizes else None,
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
        # An operator's pin (mode, plan, since): the re-plan loop and the tuner leave the model.
        "pin": s.pin,
        # The input shape of the traffic served (tokens, pixels, generated: requests, mean, p50, p90).
        "traffic": s.traffic,
        # The last swap's version and plan while TorchServe no longer loads it (after a restart):
        # the restart watch applies it again, in `retry_in_s` at the latest past a failed try.
        "lost_plan": s.lost_plan,
    }


def render_swap(record: SwapRecord, plan: Plan, pin: dict[str, Any] | None) -> dict[str, Any]:
    """POST /v1/models/{model}/apply: the swap, the plan it applied and the model's pin."""
    return {"swap": record.to_dict(), "plan": plan.to_dict(), "pin": pin}


def render_pin(model: str, pin: dict[str, Any] | None) -> dict[str, Any]:
    """PUT /v1/models/{model}/pin: the model's pin now (None: unpinned)."""
    return {"model": model, "pinned": pin is not None, "pin": pin}


def render_tune(model: str, tune: dict[str, Any] | None) -> dict[str, Any]:
    """GET /v1/models/{model}/tune: the running or last tune (None: never tuned here)."""
    return {"model": model, "tune": tune}


def render_adapt(model: str, enabled: bool, decisions: list[Any] | None = None) -> dict[str, Any]:
    """GET (with its decisions) and PUT (without) /v1/models/{model}/adapt."""
    out: dict[str, Any] = {"model": model, "enabled": enabled}
    if decisions is not None:
        out["decisions"] = decisions
    return out


def render_health(healthy: bool, body: dict[str, Any]) -> JSONResponse:
    """GET /healthz: 200 when healthy, else 503, with the same body."""
    return JSONResponse(Health(**body).model_dump(), status_code=200 if healthy else 503)


def render_metrics(text: bytes) -> Response:
    # Prometheus' own content type (its text format version); imported here because
    # only this answer needs prometheus_client.
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(content=text, media_type=CONTENT_TYPE_LATEST)


def error_status(exc: PackratError) -> int:
    """Where each error leaf lands: the caller's fault is 4xx, TorchServe's or the swap's 5xx."""
    if isinstance(exc, TorchServeError):
        return 404 if exc.status == 404 else 502
    if isinstance(exc, (ConfigError, PlanError, ModeRefusedError)):
        return 422
    if isinstance(exc, ProfileError):
        return 404
    if isinstance(exc, BusyError):
        return 409
    return 500  # SwapError and anything else


async def render_error(_: Request, exc: PackratError) -> JSONResponse:
    """The exception handler for every PackratError a route lets through."""
    body: dict[str, Any] = {"detail": str(exc), "error": type(exc).__name__}
    if isinstance(exc, SwapError) and exc.record is not None:
        body["swap"] = exc.record.to_dict()
    return JSONResponse(status_code=error_status(exc), content=body)
