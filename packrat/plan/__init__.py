"""The optimiser: pure functions from a profile to a plan (no torch, no HTTP).

    plan(profile, cores, batch, *, rtol=0.0, cover=False) -> Plan   exact min–max 2-D knapsack
    realizable_plan(profile, cores, batch)       best plan with one shared batch cap
    load_profile(path) -> Profile                Packrat JSON or CSV profile files
    plans_per_mode(profiles, cores, batch)       one plan per execution mode + the overall choice
"""

from __future__ import annotations

from packrat.plan.io import load_profile
from packrat.plan.knapsack import (
    fat_latency,
    optimal_plan,
    realizable_gap,
    realizable_plan,
)
from packrat.plan.modes import ModePlan, plans_per_mode

# `plan` is the name the design uses for the pure decision function.
plan = optimal_plan

__all__ = [
    "ModePlan",
    "fat_latency",
    "load_profile",
    "optimal_plan",
    "plan",
    "plans_per_mode",
    "realizable_gap",
    "realizable_plan",
]
