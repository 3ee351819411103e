"""The typed seams of packrat.types: Decision and Estimate (observe -> control, REST, bench)
and TuneRecord (tune -> control, REST) read back what the code before them wrote,
byte for byte, and name what is malformed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from packrat.observe.estimator import EstimatorState, estimate
from packrat.observe.policy import PolicyContext, PolicyState, decide
from packrat.types import Decision, Estimate, Instance, Observation, Plan

DATA = Path(__file__).parent / "data"
PLAN = Plan(cores=2, batch=4, instances=(Instance(1, 2, 20.0),) * 2, predicted_latency_ms=20.0,
            fat_latency_ms=25.0)


def test_decision_lines_written_before_the_type_load_and_write_back_the_same_bytes() -> None:
    lines = (DATA / "observe" / "decisions-old.jsonl").read_text().splitlines()
    decisions = [Decision.from_dict(json.loads(line)) for line in lines]
    assert {d.reason for d in decisions} >= {"warming-up", "no-active-plan"}
    swaps = [d for d in decisions if d.swap]
    assert swaps and all(isinstance(d.target, Plan) and d.target.instances for d in swaps)
    for line, d in zip(lines, decisions):
        old = json.loads(line)
        if "step" in old["estimate"]:  # the current format: written back byte for byte
            assert json.dumps(d.to_dict(), separators=(",", ":")) == line
        else:  # older lines (no step, no dwell_s): every key they had reads the same
            new = d.to_dict()
            assert {k: new[k] for k in old if k != "estimate"} == {k: v for k, v in old.items() if k != "estimate"}
            assert {k: new["estimate"][k] for k in old["estimate"]} == old["estimate"]
            assert new["estimate"]["step"] is False and new["dwell_s"] is None


def test_a_decision_of_the_policy_round_trips() -> None:
    est = Estimate(time_s=10.0, model="m", batch=4, ready=True, concurrency=4.1234567, ewma=3.9,
                   rounded=4, request_rate=200.0, mean_latency_ms=21.0, mean_queue_ms=1.0, span_s=5.0)
    ctx = PolicyContext(now_s=10.0, model="m", estimate=est, current=None, current_latency_ms=None,
                        candidates=(PLAN,))
    d, _ = decide(PolicyState(seen_batch=4, seen_since_s=0.0), ctx)
    assert d.swap and d.target == PLAN
    back = Decision.from_dict(json.loads(json.dumps(d.to_dict())))
    assert back.to_dict() == d.to_dict()
    assert back.target == PLAN and back.estimate.concurrency == pytest.approx(4.1235)
    assert back.estimate.mean_service_ms == pytest.approx(20.0)


@pytest.mark.parametrize("change, named", [
    (lambda d: d.pop("reason"), "reason"),
    (lambda d: d.update(swap="yes"), "swap"),
    (lambda d: d.update(estimate=[]), "estimate"),
    (lambda d: d.update(estimated_batch="four"), "estimated_batch"),
    (lambda d: d.update(corrected_gain="big"), "corrected_gain"),
    (lambda d: d.update(target={"batch": 4}), "plan"),
])
def test_a_malformed_decision_is_named(change, named: str) -> None:
    line = json.loads((DATA / "observe" / "decisions-old.jsonl").read_text().splitlines()[-1])
    change(line)
    with pytest.raises(ValueError, match=named):
        Decision.from_dict(line)
    with pytest.raises(ValueError, match="not an object"):
        Decision.from_dict([line])


def test_an_estimate_round_trips() -> None:
    state = EstimatorState()
    for t in range(8):
        est, state = estimate(state, Observation(float(t), "m", 10.0 * t, 40_000.0 * t, 1_000.0 * t, 0))
    assert est.ready and est.concurrency is not None
    assert Estimate.from_dict(json.loads(json.dumps(est.to_dict()))) == est
    with pytest.raises(ValueError, match="batch"):
        Estimate.from_dict(dict(est.to_dict(), batch=[4]))
    assert replace(est, step=True) != est
