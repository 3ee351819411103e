"""The optimiser: pure functions from a profile to a plan (no torch, no HTTP, no files).

    plan(profile, cores, batch, *, rtol=0.0, cover=False) -> Plan   exact min–max 2-D knapsack
    realizable_plan(profile, cores, batch)       best plan with one shared batch cap; fat unless
                                                 beaten beyond the profile's noise (confidence)
    plans_per_mode(profiles, cores, batch)       one plan per execution mode + the overall choice
    mode_candidates(profiles, cores, batch)      the re-plan policy's candidates across modes
    candidate_plans(profile, cores, batch)       the realisable plan, then the other uniform plans
    every_uniform_plan(cores, batch, profile)    every uniform shape (the bench's oracle)
    plan_latency_at(profile, plan, batch)        a plan's predicted latency at another batch
    plan_from_shape(shape, cores, profile)       an explicit plan, predicted where profiled

Profiles are read by packrat.profile.load_profile.
"""

from __future__ import annotations

from packrat.plan.candidates import (
    candidate_plans,
    every_uniform_plan,
    plan_from_shape,
    plan_latency_at,
    same_shape,
    uniform_candidates,
    uniform_plan,
)
from packrat.plan.knapsack import (
    fat_latency,
    optimal_plan,
    realizable_gap,
    realizable_plan,
)
from packrat.plan.modes import MODE_MARGIN, ModePlan, fastest, mode_candidates, plans_per_mode

# `plan` is the name the design uses for the pure decision function.
plan = optimal_plan

__all__ = [
    "MODE_MARGIN",
    "ModePlan",
    "candidate_plans",
    "every_uniform_plan",
    "fastest",
    "mode_candidates",
    "fat_latency",
    "optimal_plan",
    "plan",
    "plan_from_shape",
    "plan_latency_at",
    "plans_per_mode",
    "realizable_gap",
    "realizable_plan",
    "same_shape",
    "uniform_candidates",
    "uniform_plan",
]
