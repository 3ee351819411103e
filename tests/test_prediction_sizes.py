"""Every prediction says which input shape it is for (issue 32 item 3): a plan made from a
profile carries the profile's timed sizes, and status, /metrics and the status page show
them beside the traffic's; the controller's ticks hand the policy the traffic's sizes lately."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from packrat import slots
from packrat.api.answers import render_status
from packrat.control.metrics import LivePlans
from packrat.control.traffic import TrafficShapes
from packrat.control.values import ModelState, ModelStatus, WorkerState
from packrat.plan import optimal_plan, plan_from_shape, realizable_plan, uniform_plan
from packrat.plan.confidence import fat_plan
from packrat.types import Plan, Profile, ProfilePoint, profile_sizes
from packrat.worker_counters import LiveCounters

POINTS = tuple(ProfilePoint(threads=t, batch=b, mean_ms=10.0 * b / t) for t in (1, 2) for b in (1, 2, 4))
TIMED = Profile(model_id="m", points=POINTS, extra={"settings": {"sizes": [["tokens", 5]]}})
UNTIMED = Profile(model_id="m", points=POINTS)  # made before profiles recorded their sizes


def test_plans_made_from_a_profile_say_the_sizes_it_was_timed_at() -> None:
    assert profile_sizes(TIMED) == (("tokens", 5),) and profile_sizes(UNTIMED) == profile_sizes(None) == ()
    made = [realizable_plan(TIMED, 2, 4), optimal_plan(TIMED, 2, 4), uniform_plan(2, 1, 2, 2, 4, TIMED),
            plan_from_shape([(1, 2), (1, 2)], 2, TIMED), fat_plan(TIMED, 2, 4)]
    assert [p.sizes for p in made] == [(("tokens", 5),)] * len(made)
    assert realizable_plan(UNTIMED, 2, 4).sizes == ()
    # No prediction, no sizes: an explicit plan without a profile, or with unprofiled points.
    assert plan_from_shape([(1, 8)], 2, None).sizes == () and plan_from_shape([(1, 8)], 2, TIMED).sizes == ()


def test_a_plans_sizes_round_trip_and_old_records_read_back_the_same() -> None:
    plan = realizable_plan(TIMED, 2, 4)
    d = plan.to_dict()
    assert d["sizes"] == {"tokens": 5}
    assert Plan.from_dict(json.loads(json.dumps(d))).sizes == (("tokens", 5),)
    old = {k: v for k, v in d.items() if k != "sizes"}  # a record of before
    assert Plan.from_dict(old).sizes == () and Plan.from_dict(old).to_dict() == old
    # What a figure is for takes no part in equality (a live plan read back equals its plan).
    assert Plan.from_dict(old) == plan
    with pytest.raises(ValueError, match="malformed plan"):
        Plan.from_dict({**d, "sizes": ["tokens", 5]})


def test_status_and_metrics_say_what_the_prediction_is_for(tmp_path: Path) -> None:
    plan = replace(realizable_plan(TIMED, 2, 4), mode="fp32-eager")
    st = ModelState(model="bert", version="2", url="bert.2", plan=plan, workers=(), other_versions=())
    status = render_status(ModelStatus(state=st, observed=None, swap_in_progress=None, last_swaps=(), adapt=None))
    assert status["predicted_for"] == {"tokens": 5} and status["plan"]["sizes"] == {"tokens": 5}
    untimed = replace(st, plan=realizable_plan(UNTIMED, 2, 4))
    assert render_status(ModelStatus(state=untimed, observed=None, swap_in_progress=None, last_swaps=(),
                                     adapt=None))["predicted_for"] is None
    registry = CollectorRegistry()
    plans = {"bert": {"plan": plan.to_dict(), "version": "2", "url": "bert.2"},
             "old": {"plan": realizable_plan(UNTIMED, 2, 4).to_dict(), "version": "1", "url": "old.1"}}
    registry.register(LivePlans(lambda: plans, tmp_path))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'packrat_prediction_size{kind="tokens",model="bert"} 5.0' in text
    assert 'packrat_prediction_size{kind="tokens",model="old"}' not in text  # not known: absent


def test_ticks_read_the_traffic_lately_at_a_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TrafficShapes.recent: what the ticks saw served in the last window (status reads do
    not count), as representative sizes at the batch asked for; the policy gets these."""
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(tmp_path / "slots"))
    slots.secure_dir(slots.slot_root())
    slots.secure_dir(slots.slot_root() / "workers")
    counters = LiveCounters(slots.worker_counters_path(301))
    st = ModelState(model="bert", version="1", url="bert.1", plan=None,
                    workers=(WorkerState({"pid": 301, "status": "READY"}, None),), other_versions=())
    traffic = TrafficShapes(window_s=30.0)
    counters.add_sizes({"tokens": [3] * 100})  # sizes below 4 are exact
    traffic.update(st)  # a status read: not a tick
    assert traffic.recent("bert", 1) == ()
    traffic.update_all([st], now=0.0)
    assert traffic.recent("bert", 1) == (("tokens", 3),)
    counters.add_sizes({"tokens": [128] * 40})
    traffic.update_all([st], now=40.0)  # the last 40 s: only long texts, though 100 short ones came first
    assert traffic.recent("bert", 1)[0][1] >= 100
    traffic.update_all([], now=41.0)  # no longer listed: forgotten
    assert traffic.recent("bert", 1) == ()


def test_why_reprofile_is_gone() -> None:
    """The Reprofiler follows RecentSizes (40d5361); the helper nothing called went."""
    import packrat.control.traffic as traffic

    assert not hasattr(traffic, "why_reprofile")


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's functions")
def test_the_status_page_writes_the_sizes_a_prediction_is_for() -> None:
    js = (Path(__file__).resolve().parents[1] / "packrat" / "web" / "app.js").read_text()
    function = re.search(r"^function sizesText\(.*?^}$", js, re.M | re.S).group(0)
    cases = [{"tokens": 5}, {"pixels": 307200, "tokens": 3}, {}, None]
    script = function + f"\nfor (const v of {json.dumps(cases)}) console.log(sizesText(v));"
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == ["tokens 5", "pixels 307200, tokens 3", "not known", "not known"]
    assert '["predicted for", ' in js and "sizesText(status.predicted_for)" in js
