"""Cores among models.

With the re-plan loop on, each tick divides the usable cores (packrat.cores:
affinity ∩ cgroup cpuset, capped by the CPU quota) among the models with load,
minimising the worst model's predicted latency (packrat.plan.share), with the
policy's gain threshold as hysteresis. A model has load for the division only
while its load overlaps the others' in time: one quiet (Estimate.quiet_s) for
`concurrent_quiet_s`, or longer where its own gaps between requests are longer
(quiet_after_s), counts as idle here, though its 5 s window still reads the
load it had. So load alternating between models every few seconds gives each
one the whole machine in turn instead of a split that fits neither. Each model is planned for its own cores
and its versions pin inside them; a model whose workers run outside its cores
is moved ("cores-moved"), shrinking ones first. A model idle for
`idle_footprint_after_s` moves to one 1-thread worker on the shared core (the
last one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from packrat.control.metrics import ControllerMetrics
from packrat.control.statefiles import StateFiles
from packrat.control.values import ModelState
from packrat.errors import PackratError
from packrat.plan import mode_candidates, plan_from_shape, realizable_plan
from packrat.plan.share import Demand, Division, divide_cores, keep_or_move
from packrat.profile import load_profile
from packrat.types import Estimate, Plan, Policy, Profile

log = logging.getLogger("packrat.controller")

Predictor = Callable[[int], float | None]  # cores -> predicted latency (ms), None: cannot say

# A pause shorter than this many of the model's own mean gaps between requests, or this
# many of its mean latencies (a batch's requests finish in one lump), is part of its load:
# a request every 3 s does not flip the division at each gap (Poisson arrivals leave a gap
# of 5 mean gaps once in ~150), and requests in a worker show no counter move until done.
QUIET_GAPS = 5.0
QUIET_LATENCIES = 2.0


def quiet_after_s(est: Estimate, floor_s: float) -> float:
    """How long `est`'s model must be quiet to count as idle for the division: `floor_s`,
    QUIET_GAPS arrival gaps or QUIET_LATENCIES latencies of its window, the longest."""
    out = floor_s
    if est.request_rate:
        out = max(out, QUIET_GAPS / est.request_rate)
    if est.mean_latency_ms:
        out = max(out, QUIET_LATENCIES * est.mean_latency_ms / 1000.0)
    return out


# The profiles placed at a fallback path, parsed again only when the file changes: the
# division asks every tick for each model with load (issue 35 item 4). None: unreadable.
_FALLBACKS: dict[Path, tuple[tuple[int, int, int], Profile | None]] = {}
_FALLBACKS_SIZE = 256


def _fallback_profile(path: Path) -> Profile | None:
    """The profile at `path`; None when there is none or it does not load."""
    try:
        st = path.stat()
    except OSError:
        return None
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    kept = _FALLBACKS.get(path)
    if kept is None or kept[0] != key:
        try:
            profile: Profile | None = load_profile(path)
        except PackratError:
            profile = None
        if len(_FALLBACKS) >= _FALLBACKS_SIZE:
            _FALLBACKS.pop(next(iter(_FALLBACKS)))
        kept = _FALLBACKS[path] = (key, profile)
    return kept[1]


def predictor(profiles: tuple[Profile, ...], fallback: Path, batch: int) -> Predictor | None:
    """Predicted latency of a model's best plan for `batch` on c cores: across its per-mode
    `profiles`, else from the profile at `fallback`; None without a profile."""
    if profiles:
        def across_modes(c: int) -> float | None:
            try:
                cands, _, _ = mode_candidates(profiles, c, batch, None)
            except PackratError:
                return None
            return cands[0].predicted_latency_ms if cands else None
        return across_modes
    profile = _fallback_profile(fallback)
    if profile is None:
        return None
    most = max(p.batch for p in profile.points)

    def one_profile(c: int) -> float | None:
        try:
            return realizable_plan(profile, c, min(batch, c * most)).predicted_latency_ms
        except PackratError:
            return None
    return one_profile


class CoreDivision:
    """How the usable cores are divided among the models now (cores.json survives a restart)."""

    def __init__(self, cores: Sequence[int], reason: str, files: StateFiles, metrics: ControllerMetrics,
                 weights: dict[str, float], threshold: float, idle_after_s: float,
                 concurrent_quiet_s: float = 1.5) -> None:
        self.cores, self.reason = list(cores), reason
        self.files, self.metrics = files, metrics
        self.weights, self.threshold, self.idle_after_s = weights, threshold, idle_after_s
        self.concurrent_quiet_s = concurrent_quiet_s  # the floor of quiet_after_s
        self.division: Division | None = None
        self.why: str | None = None
        self._idle_since: dict[str, float] = {}
        self._batches: dict[str, int | None] = {}

    def share_of(self, model: str) -> tuple[int, ...]:
        """The cores `model` may use now: its share, the shared core when idle, else all."""
        d = self.division
        return d.cores_of(model) if d is not None else tuple(self.cores)

    def status(self) -> dict[str, Any]:
        """What was found (usable cores and why) and how they are divided now."""
        return {"usable": list(self.cores), "reason": self.reason,
                "division": self.division.to_dict() if self.division is not None else None,
                "why": self.why}

    def misplaced(self, st: ModelState) -> bool:
        """The live version's workers run on cores outside the model's share."""
        return st.cores is not None and not set(st.cores) <= set(self.share_of(st.model))

    def load_batch(self, policy: Policy, model: str) -> int | None:
        """The estimated B of `model`'s load from the re-plan loop's latest decision;
        None when idle or quiet (module doc). While the estimate warms up, the last known
        value holds."""
        decisions = policy.last_decisions(model, last=1)
        if decisions and decisions[-1].estimate.ready:
            est = decisions[-1].estimate
            quiet = est.quiet_s is not None and est.quiet_s >= quiet_after_s(est, self.concurrent_quiet_s)
            self._batches[model] = None if est.idle or quiet else est.batch
        return self._batches.get(model)

    def divide(self, demands: list[Demand], models: Sequence[str]) -> Division:
        """Divide the usable cores among the models by their load (kept unless the
        re-division is predicted `threshold` better); saved to cores.json."""
        previous = self.division
        if previous is None:
            saved = self.files.saved_division()
            try:
                previous = Division.from_dict(saved) if saved else None
            except (KeyError, TypeError, ValueError):
                previous = None
        proposed = divide_cores(demands, self.cores)
        division, why = keep_or_move(previous, proposed, demands, self.threshold)
        changed = previous is None or division.shares != previous.shares or division.rule != previous.rule
        if changed:
            log.info("cores divided (%s, %s): %s; idle models %s on the shared cores %s", division.rule, why,
                     {m: list(c) for m, c in division.shares.items()}, list(division.idle),
                     list(division.shared))
        if previous is not None and changed:
            self.metrics.redivisions.labels(why).inc()
        for model in models:
            self.metrics.model_cores.labels(model).set(len(division.cores_of(model)))
        if division != self.division:
            self.files.save_division({"division": division.to_dict(), "why": why, "reason": self.reason})
        self.division, self.why = division, why
        return division

    def demand(self, policy: Policy, st: ModelState, profiles: tuple[Profile, ...], fallback: Path) -> Demand:
        """What `st.model` asks of the cores this tick: its load and how its latency falls with cores."""
        batch = self.load_batch(policy, st.model)
        predict = predictor(profiles, fallback, batch) if batch is not None and st.plan is not None else None
        return Demand(st.model, batch, predict, self.weights.get(st.model, 1.0))

    def footprint(self, states: dict[str, ModelState], now: float,
                  override: Callable[[ModelState], str | None]) -> tuple[str, Plan, float] | None:
        """A model idle for idle_after_s to move onto the shared core (1 worker, 1 thread)
        while other models have load: (model, its plan there, seconds idle), or None."""
        d = self.division
        if d is None or d.rule != "split":
            self._idle_since.clear()
            return None
        for model in list(self._idle_since):
            if model not in d.idle:
                del self._idle_since[model]
        for model in d.idle:
            since = self._idle_since.setdefault(model, now)
            st = states.get(model)
            if st is None or st.plan is None or st.cores is None or set(st.cores) <= set(d.shared):
                continue
            if now - since < self.idle_after_s:
                continue
            cap = max(i.batch for i in st.plan.instances)
            plan = replace(plan_from_shape([(1, cap)], len(d.shared), None), mode=st.plan.mode or override(st))
            return model, plan, now - since
        return None
