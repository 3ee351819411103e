"""Choosing the execution mode: the optimiser run once per mode's profile.

A mode (`<precision>-<runtime>`, see docs/modes.md) changes the latency table
L(t, b) itself, so each mode is profiled separately (one profile per mode;
the mode is in the profile's fingerprint) and the choice is

    best = argmin over modes m of  plan(L_m, T, B).predicted_latency_ms

Ties (equal predicted latency) go to the mode listed first among the
profiles, so the caller's order is the preference order. A mode with no
plan for (T, B) (e.g. batch B not coverable from its profiled points) is
reported with the reason and never chosen. Pure: no torch, no HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from packrat.errors import PlanError
from packrat.plan.knapsack import optimal_plan, realizable_plan
from packrat.types import Plan, Profile


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
    cover: bool = False,
) -> tuple[list[ModePlan], ModePlan | None]:
    """(every mode's best plan, the overall choice or None when no mode has a plan)."""
    if not profiles:
        raise PlanError("no profiles given")
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
    candidates = [(m.plan.predicted_latency_ms, i) for i, m in enumerate(out) if m.plan is not None]
    best = out[min(candidates)[1]] if candidates else None  # ties: the earlier profile
    return out, best


__all__ = ["ModePlan", "mode_of", "plans_per_mode"]
