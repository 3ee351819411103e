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
from packrat.types import Decision, Estimate, Instance, Observation, Plan, TuneModeRecord, TunePlanRow, TuneRecord

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


def test_a_tune_record_written_before_the_type_loads_and_writes_back_the_same_bytes(tmp_path: Path) -> None:
    from packrat import tune

    raw = (DATA / "tune" / "record-old.json").read_text()  # written by packrat.tune's Tracker of before
    rec = TuneRecord.from_dict(json.loads(raw))
    assert json.dumps(rec.to_dict(), indent=1, default=str) == raw
    assert (rec.state, rec.stage, rec.batch, rec.candidates) == ("done", "applied", 4,
                                                                 ("fp32-eager", "fp32-torchscript", "int8-eager"))
    refused = rec.modes["int8-eager"]
    assert refused.state == "refused" and "AccuracyGuardError" in (refused.reason or "")
    assert refused.model_id == rec.key["model_id"] and refused.fingerprint["mode"] == "int8-eager"
    assert rec.modes["fp32-eager"].plan == TunePlanRow(
        "fp32-eager", 20.0, 25.0, "2x(t1,b2)",
        kept="chosen before fp32-torchscript (20 ms): a later mode must be more than 3% faster")
    assert rec.modes["fp32-eager"].detail["points"] == 6
    assert isinstance(rec.choice, Plan) and rec.choice.mode == "fp32-eager"
    # load_record reads it from the state dir as the controller does
    path = tune.record_path(tmp_path, "m")
    path.parent.mkdir(parents=True)
    path.write_text(raw)
    assert tune.load_record(tmp_path, "m") == rec
    path.write_text(raw.replace('"batch": 4', '"batch": "four"'))
    assert tune.load_record(tmp_path, "m") is None  # malformed: as if never tuned (logged)


def test_the_tracker_writes_what_a_dict_update_wrote(tmp_path: Path) -> None:
    """Tracker.set/mode update the record as the dict of before did: keys in first-written
    order, new keys last, the file rewritten each time."""
    from packrat import tune

    tracker = tune.Tracker(tmp_path, "m", clock=lambda: 5.0)
    expected: dict = {"model": "m", "state": "queued", "stage": "queued", "text": "queued", "trigger": None,
                      "created": 5.0, "started": None, "finished": None, "batch": None, "budget_s": None,
                      "candidates": [], "modes": {}, "skipped": {}, "choice": None, "swap": None,
                      "error": None, "key": None}
    steps = [("set", None, {"state": "running", "capabilities": {"mode": "fp32-eager"}, "mode": "bf16-eager"}),
             ("mode", "bf16-eager", {"state": "pending", "path": "/p", "why": "not profiled"}),
             ("mode", "bf16-eager", {"state": "refused", "reason": "AccuracyGuardError", "fingerprint": {"a": 1}}),
             ("mode", "fp32-eager", {"state": "profiled", "plan": {"mode": "fp32-eager", "reason": "no plan"}}),
             ("set", None, {"choice": PLAN.to_dict(), "points_done": 3, "extra_key": [1, 2]})]
    for kind, mode, fields in steps:
        if kind == "set":
            tracker.set(**fields)
            expected.update(fields)
        else:
            tracker.mode(mode, **fields)
            expected["modes"].setdefault(mode, {}).update(fields)
        on_disk = tune.record_path(tmp_path, "m").read_text()
        assert on_disk == json.dumps(expected, indent=1, default=str)
        assert tracker.snapshot() == expected
    assert tracker.record().detail == {"extra_key": [1, 2]} and tracker.record().choice == PLAN
    snap = tracker.snapshot()
    snap["modes"]["bf16-eager"]["state"] = "changed"  # a snapshot is the caller's copy
    assert tracker.record().modes["bf16-eager"].state == "refused"


@pytest.mark.parametrize("change, named", [
    (lambda d: d.update(state=3), "state"),
    (lambda d: d.update(candidates="fp32-eager"), "candidates"),
    (lambda d: d["modes"]["int8-eager"].update(reason=["x"]), "reason"),
    (lambda d: d["modes"].update(bad=[]), "modes"),
    (lambda d: d["modes"]["fp32-eager"]["plan"].update(predicted_ms="fast"), "predicted_ms"),
    (lambda d: d.update(skipped={"bf16-eager": 1}), "skipped"),
    (lambda d: d.update(choice={"cores": 2}), "plan"),
    (lambda d: d.update(key="k"), "key"),
])
def test_a_malformed_tune_record_is_named(change, named: str) -> None:
    d = json.loads((DATA / "tune" / "record-old.json").read_text())
    change(d)
    with pytest.raises(ValueError, match=named):
        TuneRecord.from_dict(d)


def test_the_retune_rule_reads_a_record_of_a_few_keys() -> None:
    rec = TuneRecord.from_dict({"state": "done"})
    assert rec.key is None and rec.modes == {} and rec.to_dict() == {"state": "done"}
    built = TuneRecord(model="m", state="done", modes={"fp32-eager": TuneModeRecord(state="reused")})
    assert TuneRecord.from_dict(built.to_dict()) == built
    assert built.to_dict() == {"model": "m", "state": "done", "modes": {"fp32-eager": {"state": "reused"}}}


def test_the_bench_summarises_a_typed_tune_record() -> None:
    from packrat.bench.tuned import TuneOutcome, tune_summary

    d = json.loads((DATA / "tune" / "record-old.json").read_text())
    outcome = TuneOutcome("done", 61.0, TuneRecord.from_dict(d))
    assert outcome.choice() == Plan.from_dict(d["choice"])
    summary = tune_summary(outcome.record)
    assert summary["modes"]["fp32-eager"] == {k: d["modes"]["fp32-eager"][k] for k in (
        "state", "why", "plan", "points", "duration_s", "guard")}
    assert summary["modes"]["int8-eager"]["reason"] == d["modes"]["int8-eager"]["reason"]
    assert (summary["choice"], summary["swap"], summary["batch"]) == (d["choice"], d["swap"], 4)
    assert TuneOutcome("failed", 1.0).choice() is None


def test_the_cli_mode_table_reads_a_typed_tune_record() -> None:
    from packrat.commands.tune import mode_table

    d = json.loads((DATA / "tune" / "record-old.json").read_text())
    d["modes"]["bf16-eager"] = {"state": "pending"}  # no reason yet: a blank, not an IndexError
    d["skipped"] = {"bf16-openvino": "no avx512_bf16"}
    lines = mode_table(TuneRecord.from_dict(d)).splitlines()
    assert lines[1].split() == ["fp32-eager", "profiled", "20.0", "25.0", "2x(t1,b2)"]
    assert lines[3].split()[:4] == ["int8-eager", "refused", "-", "-"] and "AccuracyGuardError" in lines[3]
    assert lines[4].split() == ["bf16-eager", "pending", "-", "-"]
    assert lines[5].split() == ["bf16-openvino", "not", "tried", "-", "-", "no", "avx512_bf16"]
