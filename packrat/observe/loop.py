"""The adaptation loop as the controller's policy: counters -> B -> decide -> plan.

`AdaptiveLoop` is the controller's packrat.types.Policy (for a tuned model the
candidates come from every mode's profile, packrat.plan.mode_candidates, so the
same hysteresis moves it across (mode, shape)),

    loop(tick_context, state_dict) -> (plan to apply or None, new state_dict)

and glues the pure parts together: estimator.estimate (B from the
observation), the optimiser's candidates (packrat.plan.candidate_plans: the
realisable plan, plus the other realisable uniform plans as alternatives the
contention correction may prefer), packrat.plan.plan_latency_at (the active
plan at the new B) and policy.decide. The controller persists the returned dict, so a restarted
controller resumes with the same estimate, dwell clock and correction. The correction is kept
for one profile and one input shape (shape_rules: the traffic's sizes lately, TickContext.traffic,
against those it was learnt at and those the planned-from profile was timed at).

Side effects are limited to reporting: every decision is kept in a short in-memory
list for the status endpoint, counted in a prometheus_client registry the REST API
exports at /metrics, and handed to `emit` as one JSON line when one is given. Without
one, a decision is logged as one JSON line (logger "packrat.adapt") when it differs
from the model's last logged one other than in its time and how long the estimate has
held, and at least every REPEAT_LOG_S: four idle models repeat themselves every tick,
and writing that cost the controller more than anything else they do (issue 35 item 4).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from packrat.errors import PackratError
from packrat.observe.estimator import EstimatorSettings, estimate
from packrat.observe.persist import (
    estimator_state_from_json,
    estimator_state_to_json,
    policy_state_from_json,
    policy_state_to_json,
)
from packrat.observe.policy import PolicyContext, PolicySettings, decide
from packrat.plan import candidate_plans, mode_candidates, plan_latency_at
from packrat.profile.shape import shifted
from packrat.profile.store import load_profile
from packrat.types import Correction, Decision, Estimate, Plan, Profile, TickContext, profile_sizes

log = logging.getLogger("packrat.adapt")
# The decision log repeats an unchanged decision of a model at most this often (its clock).
REPEAT_LOG_S = 60.0


@dataclass(frozen=True)
class AdaptSettings:
    estimator: EstimatorSettings = field(default_factory=EstimatorSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)
    # Decisions kept per model for the status endpoint.
    keep_decisions: int = 50
    # New models adapt unless switched off over REST.
    enabled_by_default: bool = True


class _Metrics:
    """Prometheus series of the loop (own registry: tests and two loops do not clash)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter("packrat_adapt_decisions", "Re-plan decisions, by reason",
                                 ["model", "reason"], registry=registry)
        self.swaps = Counter("packrat_adapt_swaps", "Swaps the re-plan policy ordered",
                             ["model"], registry=registry)
        self.version_changes = Counter(
            "packrat_adapt_version_changes", "Default-version changes seen (swaps that landed)",
            ["model"], registry=registry)
        self.estimates = Counter("packrat_batch_estimates", "Ready batch estimates, by estimated B",
                                 ["model", "batch"], registry=registry)
        self.resets = Counter("packrat_counter_resets", "TorchServe counter resets (restarts) seen",
                              ["model"], registry=registry)
        self.batch = Gauge("packrat_estimated_batch", "Estimated live batch B", ["model"],
                           registry=registry)
        self.concurrency = Gauge("packrat_estimated_concurrency",
                                 "Little's-law mean concurrency of the last window", ["model"],
                                 registry=registry)
        self.active_batch = Gauge("packrat_active_plan_batch", "B the active plan was made for",
                                  ["model"], registry=registry)
        self.gain = Gauge("packrat_predicted_gain", "Corrected predicted gain of the best plan",
                          ["model"], registry=registry)
        self.gap = Gauge("packrat_latency_gap",
                         "Observed / predicted latency - 1 of the active plan (last settled tick)",
                         ["model"], registry=registry)
        self.enabled = Gauge("packrat_adapt_enabled", "1 if the model adapts, 0 if its plan is fixed",
                             ["model"], registry=registry)


class AdaptiveLoop:
    """Controller policy: estimate B each tick and ask for the plan for it when that pays."""

    def __init__(
        self,
        settings: AdaptSettings | None = None,
        registry: CollectorRegistry | None = None,
        emit: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings or AdaptSettings()
        self.registry = registry or CollectorRegistry()
        self.metrics = _Metrics(self.registry)
        self._emit = emit  # None: the decision log, changes only (module doc)
        self._logged: dict[str, tuple[Decision, float]] = {}  # per model: (last logged, timeless; its time)
        self._lock = threading.Lock()
        self._decisions: dict[str, collections.deque[Decision]] = {}
        self._pending_enable: dict[str, bool] = {}
        self._enabled: dict[str, bool] = {}
        self._profiles: dict[Path, tuple[float, Profile]] = {}

    # -- REST-facing --------------------------------------------------------------
    def set_enabled(self, model: str, enabled: bool) -> None:
        """Switch adaptation for `model`; takes effect (and is persisted) at the next tick."""
        with self._lock:
            self._pending_enable[model] = enabled
            self._enabled[model] = enabled
        self.metrics.enabled.labels(model).set(1 if enabled else 0)

    def is_enabled(self, model: str) -> bool:
        with self._lock:
            return self._enabled.get(model, self.settings.enabled_by_default)

    def last_decisions(self, model: str, last: int = 20) -> list[Decision]:
        """The model's latest decisions, oldest first."""
        with self._lock:
            return list(self._decisions.get(model, ()))[-last:]

    def decisions(self, model: str, last: int = 20) -> list[dict[str, Any]]:
        """last_decisions in their wire format (Decision.to_dict), for the REST API."""
        return [d.to_dict() for d in self.last_decisions(model, last)]

    def status(self, model: str) -> dict[str, Any]:
        recent = self.last_decisions(model, last=self.settings.keep_decisions)
        swaps = [d for d in recent if d.swap]
        return {
            "enabled": self.is_enabled(model),
            "last_decision": recent[-1].to_dict() if recent else None,
            "last_swap_decision": swaps[-1].to_dict() if swaps else None,
            "recent_decisions": [d.to_dict() for d in recent[-10:]],
        }

    def metrics_text(self) -> bytes:
        """The loop's series in Prometheus text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    # -- the policy ------------------------------------------------------------------
    def _profile(self, path: Path | None) -> Profile | None:
        if path is None:
            return None
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return None
        cached = self._profiles.get(path)
        if cached is None or cached[0] != mtime:
            # Re-read when the file changes: a re-profile through REST lands here.
            try:
                self._profiles[path] = (mtime, load_profile(path))
            except PackratError as exc:
                # Unreadable profile: keep estimating, plan nothing ("no-plan").
                log.warning("profile %s unusable: %s", path, exc)
                self._profiles[path] = (mtime, None)  # type: ignore[assignment]
        return self._profiles[path][1]

    def __call__(self, ctx: TickContext, state: dict[str, Any]) -> tuple[Plan | None, dict[str, Any]]:
        try:
            return self._tick(ctx, state)
        except Exception as exc:  # a bug here must not kill the controller's tick thread
            log.exception("adapt tick failed for %s", ctx.model)
            (self._emit or log.info)(json.dumps({"model": ctx.model, "error": repr(exc)}))
            return None, state

    def _tick(self, ctx: TickContext, state: dict[str, Any]) -> tuple[Plan | None, dict[str, Any]]:
        model: str = ctx.model
        est_state = estimator_state_from_json(state.get("estimator", {}))
        pol_state = policy_state_from_json(state.get("policy", {}))
        with self._lock:
            enabled = self._pending_enable.pop(model, state.get("enabled", self.settings.enabled_by_default))
            self._enabled[model] = enabled
        self.metrics.enabled.labels(model).set(1 if enabled else 0)

        # When did the active version come in? A version change since the last
        # tick is a swap that landed (ours or a REST apply).
        active_since = state.get("active_since_s")
        if state.get("version") is not None and state.get("version") != ctx.version:
            active_since = ctx.now
            self.metrics.version_changes.labels(model).inc()

        new_state: dict[str, Any] = dict(state, enabled=enabled, version=ctx.version,
                                         active_since_s=active_since)
        if ctx.observation is None:
            # No metrics URL configured: nothing to estimate from.
            return None, new_state

        est, est_state = estimate(est_state, ctx.observation, self.settings.estimator)
        new_state["estimator"] = estimator_state_to_json(est_state)
        self._count_estimate(model, est)

        profile = self._profile(ctx.profile_path)
        current: Plan | None = ctx.plan
        cands, current_ms = _candidates(ctx, profile, est.batch)

        # The correction is observed/profiled for the profiles and the traffic's shape it was
        # learnt at (shape_rules): a new profile (a re-profile at the traffic's sizes, a tune)
        # starts it again, else a gap learnt against 128-token figures would scale 5-token
        # ones (measured: docs/benchmarks/traffic-shape-bert-base-epyc.md, corrected 36 ms,
        # observed 84); so does traffic moved from the shape it was learnt at.
        planned_from = profiles_key(ctx.profiles or ((profile,) if profile is not None else ()))
        predicted_for = dict(profile_sizes(_scored_with(ctx.profiles, profile, current)))
        traffic = dict(ctx.traffic)
        correction, learned_at, learn = shape_rules(
            pol_state.correction, state.get("correction_sizes"), predicted_for, traffic,
            new_profiles=state.get("planned_from") not in (None, planned_from))
        new_state["planned_from"] = planned_from

        pctx = PolicyContext(
            now_s=ctx.now, model=model, estimate=est, current=current,
            current_latency_ms=current_ms, candidates=cands, enabled=enabled,
            swap_in_progress=ctx.swap_in_progress, active_since_s=active_since,
            misplaced=ctx.misplaced, learn=learn, settings=self.settings.policy,
        )
        decision, pol_state = decide(replace(pol_state, correction=correction), pctx)
        if learned_at is None and learn and traffic and decision.latency_gap is not None:
            learned_at = traffic  # its first lesson since it (re)started: the shape it is for
        new_state.pop("correction_sizes", None)
        new_state.update({"correction_sizes": learned_at} if learned_at else {})
        new_state["policy"] = policy_state_to_json(pol_state)
        decision = replace(decision, predicted_for=tuple(sorted(predicted_for.items())), traffic_sizes=ctx.traffic)
        self._report(decision)
        return (decision.target if decision.swap else None), new_state

    # -- reporting ---------------------------------------------------------------------
    def _count_estimate(self, model: str, est: Estimate) -> None:
        if est.reset:
            self.metrics.resets.labels(model).inc()
        if est.ready:
            self.metrics.estimates.labels(model, str(est.batch)).inc()
            self.metrics.batch.labels(model).set(est.batch)
        if est.concurrency is not None:
            self.metrics.concurrency.labels(model).set(est.concurrency)

    def _changed(self, d: Decision) -> bool:
        """`d` is worth a line in the decision log: it differs from the model's last logged one
        other than in time and estimate_stable_s (its estimate's time and span are not in the
        line), or that one is REPEAT_LOG_S old."""
        timeless = replace(d, time_s=0.0, estimate_stable_s=0.0,
                           estimate=replace(d.estimate, time_s=0.0, span_s=0.0))
        last = self._logged.get(d.model)
        if last is not None and last[0] == timeless and d.time_s - last[1] < REPEAT_LOG_S:
            return False
        self._logged[d.model] = (timeless, d.time_s)
        return True

    def _report(self, d: Decision) -> None:
        if self._emit is not None:
            self._emit(json.dumps(d.to_dict(), separators=(",", ":")))
        elif log.isEnabledFor(logging.INFO) and self._changed(d):
            log.info(json.dumps(d.to_dict(), separators=(",", ":")))
        with self._lock:
            q = self._decisions.setdefault(d.model, collections.deque(maxlen=self.settings.keep_decisions))
            q.append(d)
        m = self.metrics
        m.decisions.labels(d.model, d.reason).inc()
        if d.swap:
            m.swaps.labels(d.model).inc()
        if d.active_batch is not None:
            m.active_batch.labels(d.model).set(d.active_batch)
        if d.corrected_gain is not None:
            m.gain.labels(d.model).set(d.corrected_gain)
        if d.latency_gap is not None:
            m.gap.labels(d.model).set(d.latency_gap)


def adapt_settings(
    *,
    tick_s: float = 1.0,
    window_s: float | None = None,
    gain_threshold: float | None = None,
    min_dwell_s: float | None = None,
    min_stable_s: float | None = None,
) -> AdaptSettings:
    """Settings with a few commonly changed knobs overridden (None keeps the default).

    `tick_s` is only checked: the estimator's majority counts ticks, and its
    defaults assume a tick of about a second.
    """
    if tick_s <= 0:
        raise ValueError("tick_s must be positive")
    est = EstimatorSettings()
    pol = PolicySettings()
    if window_s is not None:
        est = replace(est, window_s=window_s)
    if gain_threshold is not None:
        pol = replace(pol, gain_threshold=gain_threshold)
    if min_dwell_s is not None:
        pol = replace(pol, min_dwell_s=min_dwell_s)
    if min_stable_s is not None:
        pol = replace(pol, min_stable_s=min_stable_s)
    return AdaptSettings(estimator=est, policy=pol)


def log_decisions_to(path: Path, max_bytes: int = 20_000_000, backups: int = 3) -> None:
    """Send the decision lines (one JSON object each) to a rotating file.

    A line per model whose decision changed, per tick (a second), adds up, hence the rotation.
    """
    from logging.handlers import RotatingFileHandler

    path.parent.mkdir(parents=True, exist_ok=True)
    for h in log.handlers:
        if isinstance(h, RotatingFileHandler) and Path(h.baseFilename) == path.resolve():
            return
    handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # the lines are data; keep them out of the console


def _candidates(ctx: TickContext, profile: Profile | None, batch: int) -> tuple[tuple[Plan, ...], float | None]:
    """(the plans to choose from at load `batch`, the live plan's predicted latency there)."""
    current = ctx.plan
    cands: tuple[Plan, ...] = ()
    current_ms = None
    if ctx.profiles:
        # Tuned model: (mode, shape) candidates from every mode's checked profile.
        cands, current_ms, _ = mode_candidates(ctx.profiles, ctx.cores, batch, current)
    elif profile is not None:
        # Beyond cores x the largest profiled batch no plan takes the whole
        # load at once; the plan for that many is the best there is (the
        # rest queues whatever the plan), so plan and compare at that B.
        plan_b = min(batch, ctx.cores * max(p.batch for p in profile.points))
        cands = candidate_plans(profile, ctx.cores, plan_b)
        if current is not None:
            current_ms = plan_latency_at(profile, current, plan_b)
    if current is not None and current_ms is None and current.batch == batch:
        current_ms = current.predicted_latency_ms
    return cands, current_ms


def _scored_with(profiles: tuple[Profile, ...], profile: Profile | None, current: Plan | None) -> Profile | None:
    """The profile the live plan's prediction comes from: its mode's among per-mode
    profiles (the first when none is of its mode), else the model's one profile."""
    if not profiles:
        return profile
    mode = current.mode if current is not None else None
    return next((p for p in profiles if p.fingerprint is not None and p.fingerprint.mode == mode), profiles[0])


def shape_rules(correction: Correction, learned_at: dict[str, int] | None, predicted_for: dict[str, int],
                traffic: dict[str, int], *, new_profiles: bool,
                ) -> tuple[Correction, dict[str, int] | None, bool]:
    """(the correction to decide with, the traffic sizes it was learnt at, whether this tick
    may teach it). Pure; sizes are {kind: representative size} ({}/None: not known).

    A correction is observed/predicted of one profile at one input shape, so it starts again
    (neutral, no shape) when the profiles planned from change, or when the traffic's sizes
    lately moved beyond packrat.profile.shape.shifted's factor from those it was learnt at.
    A tick whose traffic the predictions' profile does not cover (shifted from its timed
    sizes) teaches it nothing: observed/predicted then measures the other input, not the
    contention (a 5-token profile serving 128-token texts learnt the 4x clamp). Sizes not
    known on either side: the rules of before (learn; no shape to move from)."""
    if new_profiles or (learned_at and traffic and shifted(learned_at, traffic)):
        correction, learned_at = Correction(), None
    learn = not predicted_for or not traffic or not shifted(predicted_for, traffic)
    return correction, (dict(learned_at) if learned_at else None), learn


def profiles_key(profiles: tuple[Profile, ...]) -> str:
    """Which profiles a model is planned from: each one's archive, mode and creation time
    (a re-profile or tune writes a new file with a new `created`); "" for none."""
    return ";".join(sorted(
        f"{p.model_id}|{p.fingerprint.mode if p.fingerprint else ''}|{p.extra.get('created', '')}"
        for p in profiles))
