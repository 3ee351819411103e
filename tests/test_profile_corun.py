"""Co-run figures in a profile: what they mean on disk and how the optimiser uses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packrat.errors import ProfileError
from packrat.plan import plan_from_shape, plan_latency_at, realizable_plan, uniform_candidates
from packrat.profile import load_profile, save_profile
from packrat.types import Profile, ProfilePoint

# Isolated: a thin 2 x (1 thread, cap 4) plan looks faster than fat 1 x (2 threads, cap 8)
# (46 < 50 ms); measured side by side, each thin instance takes 55 ms, so fat wins.
ISOLATED = tuple(ProfilePoint(t, b, ms) for (t, b), ms in {
    (1, 1): 14.0, (1, 2): 25.0, (1, 4): 46.0, (1, 8): 90.0,
    (2, 1): 9.0, (2, 2): 15.0, (2, 4): 27.0, (2, 8): 50.0}.items())
CORUN = tuple(ProfilePoint(1, b, ms, instances=2) for b, ms in {1: 16.8, 2: 30.0, 4: 55.0}.items())


def test_corun_figures_change_the_thin_versus_fat_choice():
    isolated = Profile("m", ISOLATED)
    both = Profile("m", ISOLATED, corun=CORUN)
    assert isolated.figures == "isolated" and both.figures == "isolated+co-run"
    assert realizable_plan(isolated, 2, 8).shape == ((1, 4), (1, 4))  # 46 ms, thin
    fat = realizable_plan(both, 2, 8)
    assert fat.shape == ((2, 8),) and fat.predicted_latency_ms == 50.0
    # The thin plan scored with co-run figures, as the policy sees it.
    thin = next(p for p in uniform_candidates(both, 2, 8) if len(p.instances) == 2)
    assert thin.predicted_latency_ms == 55.0
    assert plan_latency_at(both, thin, 8) == 55.0 and plan_latency_at(isolated, thin, 8) == 46.0


def test_unmeasured_shapes_use_the_median_ratio():
    both = Profile("m", ISOLATED, corun=CORUN)
    # ratios 1.2, 1.2, 1.196: median 1.2; (1, 8) was not co-run.
    assert both.corun_factor(2) == pytest.approx(1.2)
    assert both.instance_latency(1, 8, 2) == pytest.approx(90.0 * 1.2)
    assert both.instance_latency(1, 8, 1) == 90.0  # alone: isolated
    assert both.corun_factor(1) is None
    # An explicit mixed plan: every instance scaled by the factor for its instance count.
    mixed = plan_from_shape([(1, 2), (1, 2)], 2, both)
    assert mixed.predicted_latency_ms == 30.0


def test_round_trip_and_old_profiles(tmp_path: Path):
    path = tmp_path / "p.json"
    save_profile(Profile("m", ISOLATED, corun=CORUN), path)
    data = json.loads(path.read_text())
    assert data["figures"] == "isolated+co-run" and data["corun"][0]["instances"] == 2
    assert "instances" not in data["points"][0]  # isolated points stay as before
    back = load_profile(path)
    assert back.corun == CORUN and back.points == ISOLATED
    # A profile written before co-run profiling: loads, marked isolated.
    del data["corun"], data["figures"]
    path.write_text(json.dumps(data))
    old = load_profile(path)
    assert old.corun == () and old.figures == "isolated"
    # A co-run point claiming one instance is refused with a message.
    data["corun"] = [{"instances": 1, "threads": 1, "batch": 1, "mean_ms": 3.0}]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"corun\[0\]\.instances must be >= 2"):
        load_profile(path)
