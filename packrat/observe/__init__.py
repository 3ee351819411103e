"""Observe: TorchServe's counters -> estimated batch B -> whether to re-plan.

    metrics.observation(text, model, time_s) -> Observation     parse a scrape
    estimator.estimate(state, observation, settings) -> (Estimate, state)
    policy.decide(state, context) -> (Decision, state)

All pure: the controller (packrat.control) owns the clock, the state and the I/O.
"""

from __future__ import annotations

from packrat.observe.estimator import Estimate, EstimatorSettings, EstimatorState, estimate
from packrat.observe.metrics import observation, observations, pending_from_describe
from packrat.observe.persist import (
    estimator_state_from_json,
    estimator_state_to_json,
    policy_state_from_json,
    policy_state_to_json,
)
from packrat.observe.policy import (
    Correction,
    Decision,
    PolicyContext,
    PolicySettings,
    PolicyState,
    decide,
)

__all__ = [
    "Correction",
    "Decision",
    "Estimate",
    "EstimatorSettings",
    "EstimatorState",
    "PolicyContext",
    "PolicySettings",
    "PolicyState",
    "decide",
    "estimate",
    "estimator_state_from_json",
    "estimator_state_to_json",
    "observation",
    "observations",
    "pending_from_describe",
    "policy_state_from_json",
    "policy_state_to_json",
]
