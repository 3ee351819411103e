"""Estimator and policy state <-> JSON, so the controller can persist them and a
restarted controller resumes where it stopped (the functions are pure; the
state is all there is).

The *_to_json functions build plain dicts and lists field by field: they run for every
model on every tick, and dataclasses.asdict (a deep copy, recursing into every sample of
the estimator's window) was most of what the re-plan loop cost an idle model (issue 35
item 4). Lists where the dataclasses hold tuples: what json.dumps writes either way, and
what json.loads gives back, so a state read back compares equal to the one kept.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from packrat.observe.estimator import EstimatorState
from packrat.observe.policy import PolicyState
from packrat.types import Correction, Observation

_NAMES: dict[type, tuple[str, ...]] = {}


def _flat(obj: Any) -> dict[str, Any]:
    """A dataclass of plain values (Observation, Correction) as a dict, in field order."""
    names = _NAMES.get(type(obj))
    if names is None:
        names = _NAMES[type(obj)] = tuple(f.name for f in fields(obj))
    return {n: getattr(obj, n) for n in names}


def estimator_state_to_json(state: EstimatorState) -> dict[str, Any]:
    out = _flat(state)
    out["samples"] = [_flat(o) for o in state.samples]
    out["recent"] = list(state.recent)
    out["step_base"] = _flat(state.step_base) if state.step_base is not None else None
    return out


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
        active_s=d.get("active_s"),
    )


def policy_state_to_json(state: PolicyState) -> dict[str, Any]:
    out = _flat(state)
    out["correction"] = _flat(state.correction)
    out["swap_times"] = list(state.swap_times)
    return out


def policy_state_from_json(d: dict[str, Any]) -> PolicyState:
    return PolicyState(
        last_swap_s=d.get("last_swap_s"),
        swaps=int(d.get("swaps", 0)),
        correction=Correction(**d.get("correction", {})),
        seen_batch=d.get("seen_batch"),
        seen_since_s=d.get("seen_since_s"),
        seen_step=bool(d.get("seen_step", False)),
        swap_times=tuple(float(t) for t in d.get("swap_times", ())),
        misplaced_since_s=d.get("misplaced_since_s"),
    )
