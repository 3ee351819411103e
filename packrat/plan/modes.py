"""Choosing the execution mode: the optimiser run once per mode's profile.

A mode (`<precision>-<runtime>`, see docs/modes.md) changes the latency table
L(t, b) itself, so each mode is profiled separately (one profile per mode;
the mode is in the profile's fingerprint) and the choice is

    best = argmin over modes m of  plan(L_m, T, B).predicted_latency_ms

Ties (equal predicted latency) go to the mode listed first among the
profiles, so the caller's order is the preference order; a later mode must
be faster than an earlier one by more than `margin` (default MODE_MARGIN) to
be preferred: the tune measures its modes one after another, minutes apart, so
a 1 % difference is noise, and the earlier mode is the archive's own, the
guard's reference. A mode with no
plan for (T, B) (e.g. batch B not coverable from its profiled points) is
reported with the reason and never chosen. Pure: no torch, no HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from packrat.errors import PlanError
from packrat.plan.knapsack import optimal_plan, realizable_plan
from packrat.types import Plan, Profile


# How much faster a later mode must be predicted to be chosen over an earlier one. `make
# run` 11 (2-core EPYC) chose GPT-2 bf16-eager at 2236 ms over the archive's fp32-eager at
# 2258 ms (1 %); a figure measured again on the same VM moves by more than that.
MODE_MARGIN = 0.03


@dataclass(frozen=True)
class ModePlan:
    """The best plan of one mode, or why it has none."""

    mode: str
    profile: Profile
    plan: Plan | None
    reason: str | None = None  # set when plan is None


def mode_of(profile: Profile, index: int) -> str:
    """The profile's mode from its fingerprint ("<precision>-<runtime>"), else a placeholder."""
    if profile.fingerprint is not None and profile.fingerprint.mode:
        return profile.fingerprint.mode
    return f"profile-{index + 1}"


def plans_per_mode(
    profiles: Sequence[Profile], cores: int, batch: int, *, realizable: bool = False,
    cover: bool = False, margin: float = MODE_MARGIN,
) -> tuple[list[ModePlan], ModePlan | None]:
    """(every mode's best plan, the overall choice or None when no mode has a plan).

    The choice is the first mode, in the profiles' order, whose predicted latency is
    within `margin` (a fraction) of the fastest mode's."""
    if not profiles:
        raise PlanError("no profiles given")
    if not 0.0 <= margin < 1.0:
        raise PlanError(f"margin must be in [0, 1), got {margin}")
    out: list[ModePlan] = []
    for i, profile in enumerate(profiles):
        mode = mode_of(profile, i)
        try:
            plan = (realizable_plan(profile, cores, batch) if realizable
                    else optimal_plan(profile, cores, batch, cover=cover))
        except PlanError as exc:
            out.append(ModePlan(mode, profile, None, str(exc)))
            continue
        out.append(ModePlan(mode, profile, plan))
    quickest = fastest(out)
    if quickest is None:
        return out, None
    limit = quickest.plan.predicted_latency_ms * (1.0 + margin)
    best = next(m for m in out if m.plan is not None and m.plan.predicted_latency_ms <= limit)
    return out, best


def fastest(per_mode: Sequence[ModePlan]) -> ModePlan | None:
    """The mode with the lowest predicted latency (the earlier on a tie), None if no plan.
    When it is not plans_per_mode's choice, the margin kept an earlier mode over it."""
    planned = [m for m in per_mode if m.plan is not None]
    return min(planned, key=lambda m: m.plan.predicted_latency_ms) if planned else None


def mode_candidates(
    profiles: Sequence[Profile], cores: int, batch: int, current: Plan | None = None,
) -> tuple[tuple[Plan, ...], float | None, int]:
    """What the re-plan policy chooses from across modes, at one load batch.

    Returns (candidates, the current plan's predicted latency or None, the batch
    planned at). Every candidate carries its mode; the first is the lowest
    predicted realisable plan over all modes (the optimiser's choice), then the
    rest of every mode's candidate_plans. Beyond cores x the largest profiled
    batch no plan takes the whole load at once, so plans are made (and compared)
    at that batch. The current plan is scored with the profile of its own mode.
    """
    from dataclasses import replace

    from packrat.plan.candidates import candidate_plans, plan_latency_at

    if not profiles:
        return (), None, batch
    plan_b = min(batch, cores * max(p.batch for prof in profiles for p in prof.points))
    firsts: list[Plan] = []
    rest: list[Plan] = []
    by_mode: dict[str, Profile] = {}
    for i, prof in enumerate(profiles):
        mode = mode_of(prof, i)
        by_mode.setdefault(mode, prof)
        plans = [replace(p, mode=mode) for p in candidate_plans(prof, cores, plan_b)]
        if plans:
            firsts.append(plans[0])
            rest.extend(plans[1:])
    firsts.sort(key=lambda p: p.predicted_latency_ms)  # stable: ties keep the profiles' order
    current_ms = None
    if current is not None and current.mode in by_mode:
        current_ms = plan_latency_at(by_mode[current.mode], current, plan_b)
    return tuple(firsts + rest), current_ms, plan_b


__all__ = ["MODE_MARGIN", "ModePlan", "fastest", "mode_candidates", "mode_of", "plans_per_mode"]
