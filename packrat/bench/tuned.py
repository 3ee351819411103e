"""The benchmark's tuned configurations: one tune per model, then (mode, plan) for every B.

    seed_base_profile(state_dir, model, base_mode, profile)   put the bench's own profile of the
                                  archive's mode where the tune finds it (and reuses it if valid)
    run_tune(controller, model, ...) -> TuneOutcome    Controller.start_tune, followed to its end
    mode_profiles_for(state_dir, model, base_dir, base_mode)  the per-mode profiles usable now,
                                  the archive's own mode first (it wins within MODE_MARGIN, as in the tune)
    tuned_pair(profiles, cores, batch) -> TunedPair    at load B: the best (mode, plan) over the
                                  modes' profiles ("tuned") and fat in that mode ("fat-tuned")
    fat_plan(cores, batch, mode)  1 worker x T threads, cap B, in `mode`, unpredicted

The tune runs once per model (at one representative B); the per-mode profiles
it leaves in <state dir>/profiles/<model>/<mode>.json (packrat.profile.library)
give the (mode, plan) of every other B through packrat.plan.plans_per_mode,
the same choice the tune makes, without tuning again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from packrat.errors import PlanError
from packrat.plan import every_uniform_plan, plans_per_mode
from packrat.types import Instance, Plan, Profile, TuneRecord

TUNED_CONFIGS = ("fat-tuned", "tuned")


def fat_plan(cores: int, batch: int, mode: str | None) -> Plan:
    """1 worker x `cores` threads, batch cap `batch`, in `mode` (None: the archive's own)."""
    return Plan(cores=cores, batch=batch, instances=(Instance(cores, batch, 0.0),), predicted_latency_ms=0.0,
                mode=mode)


def seed_base_profile(state_dir: Path, model: str, base_mode: str, profile: Profile) -> Path:
    """Save the bench's profile of the archive's own mode as that mode's library profile.

    The tune checks it like any other (archive hash, fingerprint, complete, batch
    range) and reuses it when valid, so the base mode is not profiled twice."""
    from packrat.profile import save_profile
    from packrat.profile.library import profile_file

    path = profile_file(state_dir, model, base_mode)
    if not path.exists():
        save_profile(profile, path)
    return path


@dataclass(frozen=True)
class TuneOutcome:
    state: str  # "done" | "failed"
    seconds: float  # start_tune to the job's end (the swap to the choice included)
    record: TuneRecord = field(default_factory=TuneRecord)  # the tune's record (packrat.tune.Tracker)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "done"

    def choice(self) -> Plan | None:
        return self.record.choice


def run_tune(controller: Any, model: str, *, batch: int, budget_s: float | None = None,
             modes: Sequence[str] | None = None, max_batch: int | None = None,
             point_budget_s: float | None = None, on_progress: Callable[[str], None] | None = None,
             poll_s: float = 1.0) -> TuneOutcome:
    """Tune `model` through `controller` (packrat.control.Controller) and wait for the end.

    The controller guards and profiles each candidate mode and applies its choice
    for `batch` by the usual swap; `on_progress` gets each new status text."""
    t0 = time.monotonic()
    job = controller.start_tune(model, batch=batch, budget_s=budget_s, modes=list(modes) if modes else None,
                                max_batch=max_batch, point_budget_s=point_budget_s, trigger="bench")
    last = None
    while job.state in ("queued", "running"):
        text = (job.progress or {}).get("text")
        if text and text != last and on_progress is not None:
            on_progress(text)
        last = text
        time.sleep(poll_s)
    return TuneOutcome(state=job.state, seconds=round(time.monotonic() - t0, 1),
                       record=TuneRecord.from_dict(job.result or job.progress or {}), error=job.error)


def mode_profiles_for(state_dir: Path, model: str, base_dir: Path, base_mode: str | None) -> list[Profile]:
    """The per-mode profiles of `model` usable now, the archive's own mode first."""
    from packrat.plan.modes import mode_of
    from packrat.profile.library import usable_profiles

    profiles = list(usable_profiles(state_dir, model, base_dir))
    return sorted(profiles, key=lambda p: mode_of(p, 0) != base_mode)  # stable: then by mode name


@dataclass(frozen=True)
class TunedPair:
    """At one load B: the tuned (mode, plan) and fat in the same mode."""

    mode: str
    tuned: Plan  # plans_per_mode's realisable choice, carrying its mode
    fat: Plan  # 1 worker x T threads, cap B, in `mode`, predicted from the mode's profile
    per_mode: tuple[dict[str, Any], ...]  # each mode's best predicted plan at B, or why it has none


def tuned_pair(profiles: Sequence[Profile], cores: int, batch: int) -> TunedPair:
    """The tune's choice at `batch` (PlanError when no mode has a plan for it)."""
    if not profiles:
        raise PlanError("no usable per-mode profile")
    per_mode, best = plans_per_mode(profiles, cores, batch, realizable=True)
    rows = tuple({"mode": mp.mode, "predicted_ms": round(mp.plan.predicted_latency_ms, 3)} if mp.plan is not None
                 else {"mode": mp.mode, "reason": mp.reason} for mp in per_mode)
    if best is None or best.plan is None:
        raise PlanError(f"no mode has a plan for B={batch}: "
                        + "; ".join(f"{r['mode']}: {r.get('reason')}" for r in rows))
    fat = every_uniform_plan(cores, batch, best.profile)[0]
    return TunedPair(mode=best.mode, tuned=replace(best.plan, mode=best.mode), fat=replace(fat, mode=best.mode),
                     per_mode=rows)


def tune_summary(record: TuneRecord) -> dict[str, Any]:
    """The parts of a tune record a report shows: per mode its state, reason, plan at the tune's B."""
    modes = {}
    for mode, m in record.modes.items():
        shown = {"state": m.state, "reason": None if m.reason is None else m.reason[:500],
                 "why": m.detail.get("why"), "plan": m.plan.to_dict() if m.plan is not None else None,
                 "points": m.detail.get("points"), "duration_s": m.detail.get("duration_s"),
                 "guard": m.detail.get("guard")}
        modes[mode] = {k: v for k, v in shown.items() if v is not None}
    return {"batch": record.batch, "budget_s": record.budget_s, "modes": modes, "skipped": dict(record.skipped),
            "choice": record.choice.to_dict() if record.choice is not None else None,
            "swap": record.swap, "text": record.text}
