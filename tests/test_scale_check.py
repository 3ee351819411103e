"""The in-process scale check (packrat.bench.scale) at T = 2 on a tiny model: it profiles,
plans, measures every layout with real pinned workers and writes what it measured."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from packrat.bench import scale
from packrat.types import Profile, ProfilePoint


def _profile(latency: dict[tuple[int, int, int], float]) -> Profile:
    iso = tuple(ProfilePoint(threads=t, batch=b, mean_ms=ms) for (i, t, b), ms in latency.items() if i == 1)
    co = tuple(ProfilePoint(threads=t, batch=b, mean_ms=ms, instances=i)
               for (i, t, b), ms in latency.items() if i > 1)
    return Profile(model_id="m", points=iso, corun=co)


def test_choices_name_fat_the_optimiser_and_the_best_thin_shape() -> None:
    # 4 cores; batch 4: fat <1 x 4 threads> 40 ms; <2 x t2, cap 2> 15 ms (co-run);
    # <4 x t1, cap 1> 12 ms (co-run) -> best thin is 4 x (t1, b1).
    lat = {(1, 4, 4): 40.0, (1, 2, 2): 14.0, (2, 2, 2): 15.0, (1, 1, 1): 11.0, (4, 1, 1): 12.0,
           (1, 4, 1): 12.0, (1, 4, 2): 22.0, (1, 1, 2): 20.0, (1, 1, 4): 38.0, (1, 2, 4): 27.0,
           (1, 2, 1): 8.0, (1, 3, 1): 9.0, (1, 3, 2): 16.0, (1, 3, 4): 30.0}
    got = {c.config: c for c in scale.choices(_profile(lat), 4, 4)}
    assert got["fat"].shape == ((4, 4),) and got["fat"].predicted_ms == 40.0
    assert got["thin"].shape == ((1, 1),) * 4 and got["thin"].predicted_ms == 12.0
    assert got["optimiser"].predicted_ms is not None and got["optimiser"].predicted_ms <= 12.0


def test_layouts_start_each_shape_once_and_serve_every_batch_it_needs() -> None:
    c = [scale.Choice("fat", 1, ((2, 1),), 5.0), scale.Choice("fat", 2, ((2, 2),), 8.0),
         scale.Choice("optimiser", 2, ((2, 2),), 8.0), scale.Choice("thin", 2, ((1, 1), (1, 1)), 6.0)]
    lays = {lay.threads: lay for lay in scale.layouts(c)}
    assert set(lays) == {(2,), (1, 1)}
    assert lays[(2,)].batches == [1, 2] and lays[(2,)].caps == [[1, 2]]
    assert lays[(1, 1)].batches == [2] and lays[(1, 1)].caps == [[1], [1]]


def test_summary_ratios_come_from_the_measured_rows() -> None:
    rows = [{"model": "m", "batch": 4, "config": cfg, "round": r, "shape": [[1, 2], [1, 2]],
             "predicted_ms": 10.0, "measured_ms": ms}
            for cfg, per in (("fat", (20.0, 22.0)), ("thin", (10.0, 12.0))) for r, ms in enumerate(per)]
    s = {x["config"]: x for x in scale.summarise(rows)}
    # fat/thin per round: 20/10 = 2.0, 22/12 = 1.833 -> median 1.917, band 1.833..2.0
    assert s["thin"]["over_fat"] == pytest.approx(statistics.median([2.0, 22 / 12]), abs=1e-3)
    assert (s["thin"]["over_fat_min"], s["thin"]["over_fat_max"]) == (pytest.approx(1.833, abs=1e-3), 2.0)
    assert s["thin"]["gap"] == pytest.approx((11.0 - 10.0) / 10.0)  # median 11 against 10


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the scale check needs 2 usable cores")
def test_scale_check_runs_at_two_cores_on_a_tiny_model(tmp_path: Path) -> None:
    # No profile budget: on a busy machine a budget would omit points, and the test is about
    # the pipeline, not the budget (the profiler's own tests cover that).
    settings = scale.ScaleSettings(out=tmp_path, models=("tiny-resnet",), cores=2, batches=(1, 2, 4),
                                   profile_budget_s=None, point_budget_s=0.5, measure_s=0.4, rounds=2)
    head = scale.run(settings)
    rows = [json.loads(line) for line in (tmp_path / "scale-results.jsonl").read_text().splitlines()]
    assert head["cores"] == 2 and head["machine"]["cpu"]
    fat = [r for r in rows if r["config"] == "fat"]
    assert {r["batch"] for r in fat} == {1, 2, 4} and {r["round"] for r in fat} == {0, 1}
    assert all(r["shape"] == [[2, r["batch"]]] for r in fat)
    thin = [r for r in rows if r["config"] == "thin"]
    assert thin and all(len(r["shape"]) == 2 and sum(t for t, _ in r["shape"]) == 2 for r in thin)
    for r in rows:  # every configuration measured with all its instances, each a real worker
        assert r["measured_ms"] is not None and r["measured_ms"] > 0, r
        assert len(r["per_instance_ms"]) == len(r["shape"]) and r["measured_ms"] == max(r["per_instance_ms"])
    summary = (tmp_path / "scale-summary.md").read_text()
    assert "| tiny-resnet | 4 | fat |" in summary and "Targets:" in summary
    assert (tmp_path / "scale-profile-tiny-resnet.json").is_file()
