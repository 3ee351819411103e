"""What a request may carry, and turning it into the controller's arguments.

The bodies are pydantic models: FastAPI validates them (422 with the errors)
and documents them in the spec. The checks FastAPI cannot express (a model
that is not registered, a body that names both plan forms) are here too, so
each route only parses, calls the controller and renders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from fastapi import HTTPException, Query
from pydantic import BaseModel, Field

from packrat import settings
from packrat.jobs import Job
from packrat.control import Controller, ModelState
from packrat.errors import ConfigError
from packrat.types import Plan, Policy

# The largest request body accepted: an explicit plan of a few hundred instances
# is a few kB; anything near this is not a request to this API.
MAX_BODY_BYTES = 64 * 1024

# Bounds on what an authenticated caller may ask for (issue 31): a value past one is
# answered 422 naming it, before anything is planned, queued or applied.
# The largest batch (a worker's batch cap, a load to plan for, a profiled batch):
# TorchServe would take 100000000 as batchSize and hold requests for it.
MAX_BATCH = 1024
# Cores, threads and instances: a static ceiling for the spec; the usable cores of
# this controller are the real bound (requested_plan, Planner.plan_for, ProfileSettings).
MAX_CORES = 1024
# A profile holds the shared profiling queue (profiles and tunes take turns) this long at most.
MAX_PROFILE_BUDGET_S = 3600.0
# `last` of the history reads (swaps, decisions, jobs).
MAX_LAST = 1000
Last = Annotated[int, Query(ge=1, le=MAX_LAST, description=f"how many, newest last (1..{MAX_LAST})")]


class InstanceIn(BaseModel):
    threads: int = Field(ge=1, le=MAX_CORES, description="intra-op threads = cores of this worker "
                                                          "(all instances together: at most the usable cores)")
    batch: int = Field(ge=1, le=MAX_BATCH, description="batch cap; every instance of one plan must share it")


class PlanRequest(BaseModel):
    batch: int = Field(ge=1, le=MAX_BATCH, description="load batch B (concurrent requests) to plan for")
    cores: int | None = Field(default=None, ge=1, le=MAX_CORES,
                              description="cores to plan on, at most the usable ones [default: all usable]")


class ApplyRequest(BaseModel):
    """Either `batch` (a plan is computed from the model's profile) or explicit `instances`;
    optionally the execution `mode` to run them in. An apply pins the model unless `pin` is false."""

    batch: int | None = Field(default=None, ge=1, le=MAX_BATCH)
    instances: list[InstanceIn] | None = Field(default=None, min_length=1, max_length=MAX_CORES)
    mode: str | None = Field(
        default=None, min_length=3, max_length=64,
        description="execution mode <precision>-<runtime>, e.g. fp32-eager [default: the live mode]; "
                    "refused (422, with the reason) when this machine cannot run it for this archive "
                    "or it failed its accuracy guard in the model's last tune")
    pin: bool = Field(
        default=True,
        description="pin the model to this (mode, plan): the re-plan loop and the tuner leave it "
                    'until PUT /v1/models/{model}/pin {"pinned": false}')


class PinRequest(BaseModel):
    pinned: bool = Field(description="true: pin what is live now; false: unpin (the loop and the tuner may act)")


class ProfileRequest(BaseModel):
    max_batch: int = Field(default=8, ge=1, le=MAX_BATCH)
    # Required positive and bounded: null or no bound would hold the shared profiling queue.
    budget_s: float = Field(default=120.0, gt=0, le=MAX_PROFILE_BUDGET_S,
                            description=f"whole profiling run [s], at most {MAX_PROFILE_BUDGET_S:.0f}")
    cores: int | None = Field(default=None, ge=1, le=MAX_CORES,
                              description="cores to profile on, at most the usable ones [default: all usable]")


def _default(name: str) -> str:
    """A tune's default as the settings table has it (the tune applies it to a field left unset)."""
    return settings.get(name).default_text()


class TuneRequest(BaseModel):
    """Every field optional; no body at all means the defaults."""

    modes: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        default=None, max_length=32,
        description="modes to try besides the archive's own, e.g. ['bf16-openvino']; ['all'] = every "
                    "supported mode [default: a short list per task, docs/tuning.md]; modes an earlier tune "
                    "measured, still valid, are compared too unless fresh")
    budget_s: float | None = Field(
        default=None, gt=0, le=24 * 3600,
        description=f"the whole tune of this model [s] (default {_default('tune_budget_s')})")
    batch: int | None = Field(
        default=None, ge=1, le=MAX_BATCH,
        description=f"load batch B to choose for [default: observed, else {_default('tune_batch')}]")
    fresh: bool = Field(default=False, description="re-profile modes whose profile is still valid")
    max_batch: int | None = Field(
        default=None, ge=1, le=MAX_BATCH,
        description=f"largest profiled batch [default: max(batch, {_default('tune_max_batch')})]")
    point_budget_s: float | None = Field(
        default=None, gt=0, le=600,
        description=f"seconds per profiled point [default {_default('tune_point_budget_s')}]")


class AdaptRequest(BaseModel):
    enabled: bool = Field(description="false: keep the current plan fixed (no automatic re-plan)")


def known_model(controller: Controller, model: str) -> str:
    """`model` if TorchServe has it registered, else 404 naming the ones it has."""
    models = controller.models()
    if model not in models:
        raise HTTPException(404, f"unknown model {model!r}; registered: {models}")
    return model


def known_job(job: Job | None, job_id: str) -> Job:
    """The job the controller found for `job_id`, else 404."""
    if job is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return job


def replan_loop(controller: Controller, model: str) -> Policy:
    """The re-plan loop for a known `model`; 409 when this controller runs without one."""
    known_model(controller, model)
    if controller.policy is None:
        raise HTTPException(409, "the re-plan loop is not running in this controller")
    return controller.policy


def reading_or_broken(controller: Controller, model: str, default_url: str | None = None) -> ModelState | str:
    """One reading of `model`, or why it cannot be read: its live version's files are
    broken (a model_config.yaml that does not parse). The other models are served."""
    try:
        return controller.model_state(model, default_url)
    except ConfigError as exc:
        return f"model {model!r} is broken: {exc}; fix that file, or register the model again"


def model_reading(controller: Controller, model: str, listed: Mapping[str, str] | None = None) -> ModelState:
    """The request's one reading of a known `model` (404 naming the registered ones if not,
    409 saying why if its files are broken): passed on to whatever the route calls, never read again.
    `listed`: Controller.fresh_models(); a model it lists costs one describe call, not a list
    call and two describes (one unregistered since is TorchServe's 404)."""
    url = listed.get(model) if listed is not None else None
    if url is None:  # not in a fresh tick's list: TorchServe is asked
        known_model(controller, model)
    st = reading_or_broken(controller, model, url)
    if isinstance(st, str):
        raise HTTPException(409, st)
    return st


def requested_plan(controller: Controller, st: ModelState, req: ApplyRequest) -> Plan:
    """The plan an apply body asks for: the explicit `instances`, or one computed for `batch`,
    in the `mode` asked for (checked: 422 with the reason) or the live one."""
    if (req.batch is None) == (req.instances is None):
        raise HTTPException(422, "give exactly one of `batch` (computed plan) or `instances` (explicit plan)")
    mode = req.mode.strip().lower() if req.mode is not None else None
    if req.instances is not None:
        threads = sum(i.threads for i in req.instances)
        if threads > len(controller.cores):  # also bounds the instances: each has a thread
            raise HTTPException(422, f"the instances need {threads} threads; this controller has "
                                     f"{len(controller.cores)} usable cores (threads <= usable cores)")
        return controller.explicit_plan(st.model, [(i.threads, i.batch) for i in req.instances], st=st, mode=mode)
    assert req.batch is not None
    return controller.plan_for(st.model, req.batch, st=st, mode=mode)
