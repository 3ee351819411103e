"""Estimator and policy state <-> JSON, so the controller can persist them and a
restarted controller resumes where it stopped (the functions are pure; the
state is all there is)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from packrat.observe.estimator import EstimatorState
from packrat.observe.policy import PolicyState
from packrat.types import Correction, Observation


def estimator_state_to_json(state: EstimatorState) -> dict[str, Any]:
    return asdict(state)


def estimator_state_from_json(d: dict[str, Any]) -> EstimatorState:
    return EstimatorState(
        samples=tuple(Observation(**o) for o in d.get("samples", ())),
        ewma=d.get("ewma"),
        recent=tuple(int(x) for x in d.get("recent", ())),
        batch=int(d.get("batch", 1)),
        resets=int(d.get("resets", 0)),
        voted=bool(d.get("voted", False)),
        latency_ms=d.get("latency_ms"),
        step_dir=int(d.get("step_dir", 0)),
        step_count=int(d.get("step_count", 0)),
        step_base=Observation(**d["step_base"]) if d.get("step_base") else None,
    )


def policy_state_to_json(state: PolicyState) -> dict[str, Any]:
    return asdict(state)


def policy_state_from_json(d: dict[str, Any]) -> PolicyState:
    return PolicyState(
        last_swap_s=d.get("last_swap_s"),
        swaps=int(d.get("swaps", 0)),
        correction=Correction(**d.get("correction", {})),
        seen_batch=d.get("seen_batch"),
        seen_since_s=d.get("seen_since_s"),
        swap_times=tuple(float(t) for t in d.get("swap_times", ())),
        misplaced_since_s=d.get("misplaced_since_s"),
    )
