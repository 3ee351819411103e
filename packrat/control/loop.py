"""The tick: one round of the restart watch, the division of cores, and the injected
re-plan policy over every model, each model read once (its ModelState) for the round.

Swaps start on the swap thread (a tick returns at once). An exception in one part
of a tick is logged and counted (packrat_controller_tick_errors_total), and the
other parts and models still get their turn.

The policy's state is saved once per tick, after every model's turn, and only when it
changed (packrat.control.statefiles: a change only in QUIET_STATE_KEYS is written at most
every POLICY_STATE_QUIET_S). TorchServe's metrics are scraped once per tick for all
models (Observer.one_scrape), and an idle model is described again only after
IDLE_REREAD_S, a request or a swap (Ticker._reading): four idle models of five cost the
tick one scrape, not ten management calls and four YAML parses (issue 35 item 4).

A model an operator pinned (packrat.control.pins) is still handed to the policy, so
its estimate goes on, but with the policy switched off for it (the "disabled" rule),
and the idle-footprint move leaves it alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from packrat.apply.client import ManagementClient
from packrat.control.division import CoreDivision
from packrat.control.live import Observer, read_model_state
from packrat.control.metrics import ControllerMetrics
from packrat.control.pins import Pins
from packrat.control.planning import Planner
from packrat.control.statefiles import StateFiles
from packrat.control.swaps import Swaps
from packrat.control.traffic import TrafficShapes, plan_batch
from packrat.control.values import ModelState
from packrat.errors import BusyError, TorchServeError
from packrat.types import Policy, Profile, TickContext

log = logging.getLogger("packrat.controller")

# Per model, the parts of the policy's state that move every tick without a decision: the
# estimator's window and the learned latency correction (a crash loses at most
# POLICY_STATE_QUIET_S of them); swap times, the switch and the version are written at once.
QUIET_STATE_KEYS = ("estimator", "policy.correction")
# An idle model's reading is kept for this long (it changes by a swap, which resets it, by a
# request, or by TorchServe replacing a worker, which is then seen this much later).
IDLE_REREAD_S = 10.0


@dataclass(frozen=True)
class _Kept:
    state: ModelState
    requests: float | None  # TorchServe's request count when it was read
    swaps: int  # Swaps.releases then
    at: float  # time.monotonic() then


def busiest_first(models: Iterable[str], requests: Callable[[str], float]) -> list[str]:
    """`models`, those with more requests counted first (ties keep their order). After a
    TorchServe restart the restart watch applies each model's last plan again, one swap at a
    time: the model under load must not wait behind idle ones, still on their base archives
    (the new frontend counts from 0, so the counts are the traffic since it started)."""
    counted = {m: requests(m) for m in models}
    return sorted(counted, key=lambda m: -counted[m])


class Ticker:
    def __init__(self, client: ManagementClient, model_store: Path, policy: Policy | None, swaps: Swaps,
                 planner: Planner, shares: CoreDivision, files: StateFiles, observer: Observer,
                 metrics: ControllerMetrics, clock: Callable[[], float], pins: Pins) -> None:
        self.client, self.model_store, self.policy, self.swaps = client, model_store, policy, swaps
        self.planner, self.shares, self.files, self.observer = planner, shares, files, observer
        self.metrics, self.clock, self.pins = metrics, clock, pins
        self.unreachable = False  # TorchServe's management API did not answer the last tick
        self.traffic = TrafficShapes()  # the sizes each model's workers served (status, /metrics)
        self._kept: dict[str, _Kept] = {}  # each model's last reading (idle models reuse it)
        # (time.monotonic(), Swaps.releases, the models listed) of the latest tick's list
        self._listed: tuple[float, int, dict[str, str]] | None = None

    def guarded(self, where: str, fn: Callable[[], Any]) -> Any:
        """Run one part of a tick; an exception is logged and counted, never raised."""
        try:
            return fn()
        except Exception:
            self.metrics.tick_errors.inc()
            log.exception("controller tick failed (%s); continuing", where)
            return None

    def tick(self) -> list[str]:
        with self.observer.one_scrape():
            return self._tick()

    def flush(self) -> None:
        """Write the policy's state if the file is behind it (a clean stop)."""
        self.files.flush_policy_state(QUIET_STATE_KEYS)

    def _tick(self) -> list[str]:
        models = self._reachable_models()
        if models is None:
            return []
        started = self.guarded("watch", lambda: self.swaps.watch(
            list(models), models, busiest=lambda lost: busiest_first(lost, self._requests))) or []
        if self.policy is None:
            return started
        policy = self.policy
        states: dict[str, ModelState] = {}  # the tick's one reading of each model
        for model in models:
            st = self.guarded(model, lambda: self._reading(model))
            if st is not None:
                states[model] = st
        self._kept = {m: k for m, k in self._kept.items() if m in states}
        self.guarded("traffic", lambda: self.traffic.update_all(states.values(), self.clock()))
        # Each model's per-mode profiles, read and checked once for the division and its tick.
        profiles = {m: self.guarded(m, lambda: self.planner.tick_profiles(st)) or () for m, st in states.items()}
        self.guarded("divide", lambda: self.shares.divide(
            [self.shares.demand(policy, st, profiles[m], self.planner.profile_path(m)) for m, st in states.items()],
            list(states)))
        all_state = self.files.policy_state()
        # Models that must give cores back move first: no core carries two models'
        # versions beyond what one swap needs.
        order = sorted(states, key=lambda m: not self.shares.misplaced(states[m]))
        for model in order:
            if self.guarded(model, lambda: self._tick_model(policy, all_state, states[model], profiles[model])):
                started.append(model)
        self.guarded("policy state", lambda: self.files.save_policy_state(all_state, QUIET_STATE_KEYS))
        started += self.guarded("footprint", lambda: self._footprint(states)) or []
        return started

    def _requests(self, model: str) -> float:
        """The requests TorchServe counted for `model` (the tick's one scrape); 0 when unknown."""
        try:
            obs = self.observer.observe(model)
        except TorchServeError:
            return 0.0
        return 0.0 if obs is None else obs.requests_total

    def _reading(self, model: str) -> ModelState:
        """The model's reading for this tick: kept from an earlier tick while the model is idle
        (TorchServe counted no request since), no swap ended or runs, for IDLE_REREAD_S at most;
        else read from TorchServe (a describe call; the workers' pids are read, not checked
        against their slots: nothing in a tick uses the checks, which read /proc per thread)."""
        try:
            obs = self.observer.observe(model)  # the tick's one scrape, shared by every model
        except TorchServeError:
            obs = None
        seen = None if obs is None else obs.requests_total
        kept, now = self._kept.get(model), time.monotonic()
        if (kept is not None and seen is not None and kept.requests == seen and kept.swaps == self.swaps.releases
                and self.swaps.running is None and now - kept.at < IDLE_REREAD_S):
            return kept.state
        st = read_model_state(self.client, self.model_store, model, others=False)
        self._kept[model] = _Kept(st, seen, self.swaps.releases, now)
        return st

    def _reachable_models(self) -> dict[str, str] | None:
        """The models TorchServe lists, each with its default version's URL; None (and the
        unreachable gauge up) when it does not answer."""
        releases = self.swaps.releases  # before the list: a swap ending meanwhile makes it stale
        try:
            models = {m["modelName"]: m.get("modelUrl", "") for m in self.client.list_models()}
        except TorchServeError as exc:
            if not self.unreachable:
                log.warning("TorchServe's management API fails the tick's list of models: %s", exc)
            self.unreachable = True
            self.metrics.unreachable.set(1)
            return None
        if self.unreachable:
            log.warning("TorchServe's management API answers again")
            self.unreachable = False
            self.metrics.unreachable.set(0)
        self._listed = (time.monotonic(), releases, models)
        return models

    def listed(self, max_age_s: float) -> dict[str, str] | None:
        """The models the latest tick found listed (each with its default version's URL),
        when that list is at most `max_age_s` old and no swap ended or runs since; else None."""
        listed = self._listed
        if (listed is None or time.monotonic() - listed[0] > max_age_s or listed[1] != self.swaps.releases
                or self.swaps.running is not None):
            return None
        return listed[2]

    def reading(self, model: str, max_age_s: float) -> ModelState | None:
        """The latest tick's reading of `model` while its list is fresh (listed), else None."""
        kept = self._kept.get(model) if self.listed(max_age_s) is not None else None
        return kept.state if kept is not None else None

    def _tick_model(self, policy: Policy, all_state: dict[str, Any], st: ModelState,
                    profiles: tuple[Profile, ...]) -> bool:
        """Hand the policy this model's TickContext, keep its state, start the swap it asks for."""
        model = st.model
        self.pins.hold(model)  # a pinned model: the policy's "disabled" rule, also after a restart
        profile = self.planner.profile_path(model)
        plan = st.plan
        if profiles and plan is not None and plan.mode is None:
            plan = replace(plan, mode=st.mode)  # compared across modes: name the live one
        division = self.shares.division
        ctx = TickContext(
            now=self.clock(),
            model=model,
            version=st.version,
            plan=plan,
            observation=self.observer.observe(model),
            cores=len(self.shares.share_of(model)),
            profile_path=profile if profile.exists() else None,
            swap_in_progress=self.swaps.running is not None,
            profiles=profiles,
            misplaced=self.shares.misplaced(st) and model in (division.shares if division else {}),
            traffic=self.traffic.recent(model, plan_batch(st)),
        )
        new_plan, all_state[model] = policy(ctx, all_state.get(model, {}))  # saved once, after the tick
        if new_plan is None:
            return False
        try:
            self.swaps.start(model, new_plan)
        except BusyError:
            return False  # the next tick decides again
        return True

    def _footprint(self, states: dict[str, ModelState]) -> list[str]:
        """Move one model idle for idle_footprint_after_s onto the shared core (1 worker,
        1 thread), while other models have load; returns the model moved, if any."""
        unpinned = {m: st for m, st in states.items() if not self.pins.pinned(m)}  # a pin stays where it is
        move = self.shares.footprint(unpinned, self.clock(), self.planner.live_mode_override)
        if move is None:
            return []
        model, plan, idle_s = move
        try:
            self.swaps.start(model, plan)
        except BusyError:
            return []
        shared = self.shares.division.shared if self.shares.division is not None else ()
        log.info("%s: idle for %.0f s; moved to the shared core %s", model, idle_s, list(shared))
        return [model]
