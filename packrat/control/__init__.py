"""The controller: owns the live plans of one TorchServe, its clock and its state dir.

It attaches to a running TorchServe and never assumes it started it, so it can
be killed and restarted at any time without disturbing serving. This module is
the coordinator: one reading of TorchServe (a ModelState) per request or tick,
passed down to the part that does each job:

    loop        the tick: restart watch, division of cores, the policy per model

    values      ControllerSettings and the typed answers (ModelState, ModelStatus, ...)
    live        what is live, read from TorchServe; observed latency
    statefiles  the state dir's files and locks (one controller per TorchServe)
    recovery    on attach, finish what a killed controller left half done
    history     swaps.jsonl
    swaps       the swap thread (one at a time), the restart watch
    metrics     the controller's Prometheus series
    division    cores among models
    planning    profiles, plans, re-profiling
    tuning      tunes as jobs, and tuning on by default (AutoTuner)
    pins        operator pins: a model set to a (mode, plan) is left as it is until unpinned
    modecheck   whether a model may be set to a mode (supported here, not refused by its guard)
    traffic     the sizes each model's workers served (status, /metrics)
    health      GET /healthz

Any exception in a tick is logged, counted (packrat_controller_tick_errors_total
in /metrics) and the loop goes on. The re-plan decision is not made here:
`tick()` hands a packrat.types.TickContext to an injected packrat.types.Policy
`(context, state) -> (plan or None, new state)` and persists the state it
returns (after Ray Serve's autoscaling policy), so the policy can be tested by
calling it and resumes after a restart.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from packrat.apply.client import ManagementClient
from packrat.apply.swap import Swapper
from packrat.control import health as _health
from packrat.control.division import CoreDivision
from packrat.control.health import HEALTH_STALE_MIN_S, HEALTH_STALE_TICKS
from packrat.control.history import HISTORY_FILE, History
from packrat.control.live import Observer, read_model_state
from packrat.control.loop import Ticker
from packrat.control.metrics import ControllerMetrics, LivePlans
from packrat.control.pins import Pins
from packrat.control.planning import Planner
from packrat.control.recovery import attach
from packrat.control.statefiles import (CORES_FILE, LAST_PLANS_FILE, POLICY_STATE_FILE, STATE_LOCK_FILE,
                                        STORE_LOCK_FILE, StateFiles)
from packrat.control.swaps import SwapTask, Swaps
from packrat.control.tuning import AutoTuner, TuneOptions, Tuning, why_tune
from packrat.control.values import (DEFAULT_STATE_DIR, ControllerSettings, ModelState, ModelStatus,
                                    ObservedLatency, WorkerState)
from packrat.cores import usable_cores
from packrat.jobs import Job, Jobs, Turns
from packrat.types import Observation, Plan, Policy, SwapRecord

__all__ = ["CORES_FILE", "DEFAULT_STATE_DIR", "HEALTH_STALE_MIN_S", "HEALTH_STALE_TICKS", "HISTORY_FILE",
           "LAST_PLANS_FILE", "POLICY_STATE_FILE", "STATE_LOCK_FILE", "STORE_LOCK_FILE", "AutoTuner",
           "Controller", "ControllerSettings", "ModelState", "ModelStatus", "ObservedLatency", "SwapTask",
           "TuneOptions", "WorkerState", "why_tune"]


# A reading the tick took is fresh for a status answer this many ticks after (a tick is due
# every tick_s; the half tick is for the tick's own time): "at most one tick old".
FRESH_TICKS = 1.5


class Controller:
    def __init__(self, settings: ControllerSettings, policy: Policy | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings, self.policy, self.clock = settings, policy, clock
        self.files = StateFiles(settings.state_dir)
        self.state_dir = self.files.dir
        self.client = ManagementClient(settings.management_url, settings.key_file)
        if settings.cores is not None:
            cores, reason = list(settings.cores), f"given: {len(settings.cores)} cores"
        else:
            found = usable_cores()  # affinity ∩ cgroup cpuset, quota cap, $PACKRAT_CORES
            cores, reason = list(found.cores), found.reason
        self.cores: list[int] = cores
        self.registry = CollectorRegistry()
        self.metrics = ControllerMetrics(self.registry)
        self.registry.register(LivePlans(self.files.last_plans, settings.model_store))  # type: ignore[arg-type]
        self.shares = CoreDivision(cores, reason, self.files, self.metrics, settings.core_weights,
                                   settings.division_threshold, settings.idle_footprint_after_s,
                                   settings.concurrent_quiet_s)
        self.swapper = Swapper(self.client, settings.model_store, cores, settings.swap)
        self.swap_history = History(self.state_dir)
        self.swaps = Swaps(self.swapper, self.client, self.files, self.swap_history, self.metrics, clock,
                           settings.reapply_backoff_s, cores, self.shares.share_of)
        self.observer = Observer(settings.metrics_url, clock)
        self.pins = Pins(self.files, policy, clock)
        self.jobs = Jobs()
        # Profiling and tuning jobs take turns: two runs on the same cores measure each other.
        self.turns = Turns()
        self.planner = Planner(self.state_dir, settings.model_store, self.swapper, cores, self.jobs, self.turns)
        self.tuning = Tuning(self.state_dir, settings.model_store, self.swapper, cores, self.jobs, self.turns,
                             self.swaps, self.model_state, clock, settings.swap.ready_timeout_s, policy,
                             self.pins.pinned)
        self.ticker = Ticker(self.client, settings.model_store, policy, self.swaps, self.planner, self.shares,
                             self.files, self.observer, self.metrics, clock, self.pins)
        self.registry.register(self.ticker.traffic)  # type: ignore[arg-type]
        self.last_tick_at: float | None = None  # time.monotonic() the tick loop last went round

    # The swap lock and the running swap live in self.swaps.
    @property
    def running_swap(self) -> SwapRecord | None:
        return self.swaps.running

    # -- lifecycle ------------------------------------------------------------
    def acquire(self) -> None:
        """Take the state dir's lock and the model store's: one controller per TorchServe."""
        self.files.acquire(Path(self.settings.model_store),
                           f"pid {os.getpid()} management {self.settings.management_url}")

    def release(self) -> None:
        self.files.release()

    def attach(self) -> list[str]:
        """Read what is live and finish half-done swaps; returns what was cleaned up."""
        return attach(self.client, self.swapper, self.settings.model_store, self.files)

    # -- reading state ------------------------------------------------------------
    def management_key(self) -> str | None:
        """TorchServe's management key as key_file.json holds it now (the REST API's token)."""
        keys = self.client.keys()
        return keys.management.key if keys else None

    def models(self) -> list[str]:
        return [m["modelName"] for m in self.client.list_models()]

    def model_state(self, model: str, default_url: str | None = None) -> ModelState:
        """One reading of `model`'s live version: take it once per request and pass it on.
        `default_url`: its default version's directory from fresh_models (one call, not two)."""
        return read_model_state(self.client, self.settings.model_store, model, default_url=default_url)

    def fresh_models(self) -> dict[str, str] | None:
        """The models the latest tick listed, each with its default version's URL, while that
        list is fresh (at most FRESH_TICKS ticks old, no swap since); else None. A status
        answer takes it for a list call of its own (the status page asks every 5 s per model)."""
        return self.ticker.listed(FRESH_TICKS * self.settings.tick_s)

    def tick_reading(self, model: str) -> ModelState | None:
        """The latest tick's reading of `model` while that tick is fresh (fresh_models), for a
        periodic check that needs no more than a tick reads: its other_versions are () and its
        workers unchecked (WorkerState.check None). None: read it (model_state)."""
        return self.ticker.reading(model, FRESH_TICKS * self.settings.tick_s)

    def observe(self, model: str) -> Observation | None:
        """Cumulative request count and latency of `model` from TorchServe's metrics port."""
        return self.observer.observe(model)

    def history(self, model: str | None = None, last: int = 20) -> list[dict[str, Any]]:
        return self.swap_history.read(model, last)

    def status(self, model: str, st: ModelState | None = None) -> ModelStatus:
        """What GET /v1/models/{model}/status answers; the observed latency from the latest
        tick's scrape while it is at most FRESH_TICKS ticks old, else from a scrape of its own."""
        st = st or self.model_state(model)
        return ModelStatus(
            state=st,
            observed=self.observer.observed_latency(model, FRESH_TICKS * self.settings.tick_s),
            swap_in_progress=self.running_swap,
            last_swaps=tuple(self.history(model, last=10)),
            adapt=self.policy.status(model) if self.policy is not None else None,
            tune=self.tune_status(model),
            share=self.share_of(model),
            pin=self.pins.get(model),
            traffic=self.ticker.traffic.update(st),
            lost_plan=self.swaps.lost_plan(model, (st.version, *st.other_versions)),
        )

    # -- plans, profiles and tunes (st: the request's reading, else read here once) -------
    def profile_path(self, model: str) -> Path:
        return self.planner.profile_path(model)

    def plan_for(self, model: str, batch: int, cores: int | None = None, *, st: ModelState | None = None,
                 mode: str | None = None) -> Plan:
        """The optimiser's realisable plan for load `batch` from `model`'s profile in `mode`
        (default: its live mode; another is checked: packrat.control.modecheck, ConfigError)."""
        return self.planner.plan_for(st or self.model_state(model), batch, cores, mode)

    def explicit_plan(self, model: str, shape: Sequence[tuple[int, int]], *, st: ModelState | None = None,
                      mode: str | None = None) -> Plan:
        """A plan of the given (threads, batch cap) workers in `mode` (default: the live mode)."""
        return self.planner.explicit_plan(st or self.model_state(model), shape, mode)

    def start_profile(self, model: str, *, max_batch: int, budget_s: float | None, cores: int | None = None,
                      st: ModelState | None = None) -> Job:
        """Re-profile `model` in its live mode in the background; the job says when it is done."""
        return self.planner.start_profile(st or self.model_state(model), max_batch=max_batch,
                                          budget_s=budget_s, cores=cores)

    def tune_status(self, model: str) -> dict[str, Any] | None:
        """The running or last tune of `model` (stage, modes, choice), or None if never tuned."""
        return self.tuning.status(model)

    def start_tune(self, model: str, *, modes: Sequence[str] | None = None, budget_s: float | None = None,
                   batch: int | None = None, fresh: bool = False, max_batch: int | None = None,
                   point_budget_s: float | None = None, trigger: str = "request",
                   st: ModelState | None = None) -> Job:
        """Tune `model` in the background: guard and profile each candidate mode, choose
        (mode, plan) for `batch` (default: the observed B, else tune.DEFAULT_BATCH) and
        apply it by the usual swap. Tunes and profiling jobs take turns (queued).
        BusyError while a tune of this model is queued or running."""
        st = st or self.model_state(model)  # TorchServeError 404 for an unknown model
        options = TuneOptions(modes=modes, budget_s=budget_s, batch=batch, fresh=fresh, max_batch=max_batch,
                              point_budget_s=point_budget_s)
        return self.tuning.start(st, options, trigger=trigger)

    # -- acting -------------------------------------------------------------------
    def start_swap(self, model: str, plan: Plan) -> SwapTask:
        """Start swapping `model` to `plan` on the swap thread and return at once.

        The new version pins inside the model's cores (share_of) when the plan fits
        there, else on all usable cores (an explicit plan wider than the share; the
        re-plan loop moves it back when the model has load).
        BusyError while another swap runs; ConfigError / TorchServeError (unknown
        model) before anything is touched. The attempt is recorded whatever happens.
        """
        return self.swaps.start(model, plan)

    def apply(self, model: str, plan: Plan, *, pin: bool = False, st: ModelState | None = None) -> SwapRecord:
        """Swap `model` to `plan` and wait for the result (the swap runs on the swap thread).
        `pin`: pin the model to it (packrat.control.pins), before the swap starts; the pin
        it had before comes back if the swap fails."""
        if not pin:
            return self.swaps.apply(model, plan)
        old = self.pins.pin(model, plan, plan.mode or (st.mode if st is not None else None))
        try:
            return self.swaps.apply(model, plan)
        except BaseException:
            self.pins.restore(model, old)
            raise

    def pin(self, model: str, *, st: ModelState | None = None) -> dict[str, Any]:
        """Pin `model` to what is live now (no swap); returns the pin."""
        st = st or self.model_state(model)
        self.pins.pin(model, st.plan, st.mode)
        return self.pins.get(model) or {}

    def unpin(self, model: str) -> dict[str, Any] | None:
        """Let the re-plan loop and the tuner act on `model` again; returns the pin removed."""
        return self.pins.unpin(model)

    def watch(self, models: Sequence[str]) -> list[str]:
        """Apply the last plan again where its version is no longer loaded (TorchServe restarted)."""
        return self.swaps.watch(models)

    def metrics_text(self) -> bytes:
        """The controller's series and the re-plan loop's, in Prometheus text format."""
        out = generate_latest(self.registry)
        if self.policy is not None:
            out += self.policy.metrics_text()
        return out

    # -- cores among models ------------------------------------------------------------
    def share_of(self, model: str) -> tuple[int, ...]:
        """The cores `model` may use now: its share, the shared core when idle, else all."""
        return self.shares.share_of(model)

    def cores_status(self) -> dict[str, Any]:
        """What was found (usable cores and why) and how they are divided now."""
        return self.shares.status()

    # -- the tick (packrat.control.loop) ------------------------------------------------
    def tick(self) -> list[str]:
        """One round: the restart watch, then the policy over every model; returns the models
        a swap was started for (on the swap thread)."""
        return self.ticker.tick()

    def run(self, stop: threading.Event) -> None:
        """Tick until `stop` is set (the REST server runs beside it in another thread).

        Nothing a tick raises ends the loop: it is logged and counted in
        packrat_controller_tick_errors_total.
        """
        self.last_tick_at = time.monotonic()
        while not stop.wait(self.settings.tick_s):
            self.ticker.guarded("tick", self.tick)
            self.last_tick_at = time.monotonic()  # GET /healthz: the loop is alive
        self.ticker.guarded("flush", self.ticker.flush)  # the policy's newest state, for the next start

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, body) for GET /healthz, without calling TorchServe (packrat.control.health)."""
        age = None if self.last_tick_at is None else time.monotonic() - self.last_tick_at
        return _health.health(age, self.settings.tick_s, not self.ticker.unreachable, self.running_swap is not None,
                              stale_min_s=HEALTH_STALE_MIN_S)
