"""`packrat bench` end to end on the no-op model: a real TorchServe, real swaps, saved results.

The first run starts and stops its own TorchServe (asserted); the second attaches to the one
the bench modules share (bench_support, `packrat bench --attach`) and leaves it empty.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from packrat.bench.report import summarise
from packrat.bench.results import read_measurements
from packrat.bench.run import Bench, BenchSettings
from packrat.server import RunningServer
from bench_support import archives_left, no_models_left, shared_torchserve  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]


def test_bench_measures_every_configuration_and_leaves_nothing_registered(tmp_path: Path) -> None:
    # settle_s 1 (default 5, ~4 s saved per swap): the wait after a swap only steadies the
    # latency figures, and no latency is asserted here
    settings = BenchSettings(
        models=("noop",), batches=(2,), out=tmp_path, requests=30, max_point_s=30.0, settle_s=1.0,
        profile_budget_s=120.0, profile_point_budget_s=1.0, capacity=True, capacity_requests=50,
        progress=False, command="test",
    )
    bench = Bench(settings)
    results = bench.run()
    ms = read_measurements(results)
    got = {(m.batch, m.config) for m in ms}
    # at B = 2 on 2 cores: fat 1x(2t,b2), the candidate 2x(1t,b1), packrat, defaults
    assert {(2, "defaults"), (2, "fat"), (2, "oracle"), (2, "packrat")} <= got
    for m in ms:
        assert m.load["ok"] == 30 and m.load["errors"] == 0, m
        # TorchServe's own counters for the point: every request the client sent (warm-up and
        # cool-down included, so at least measured + warm-up) and a queue + worker split
        srv = m.extra["server"]
        assert srv["requests"] >= 30 + m.extra["warmup"], m
        assert srv["queue_ms"] >= 0 and srv["worker_ms"] > 0
        assert srv["mean_ms"] == pytest.approx(srv["queue_ms"] + srv["worker_ms"], abs=0.01)
        # the handler's x-packrat-batch-size header: batches never exceed the live cap
        cap = max((b for _, b in m.instances), default=1)
        assert 1.0 <= m.load["mean_batch_size"] <= cap, m
    thin = next(m for m in ms if m.batch == 2 and m.config == "oracle")
    assert thin.instances == ((1, 1), (1, 1))
    assert thin.extra["swap"]["to_version"].startswith("p")  # really applied through a swap
    rows = summarise(ms)
    assert [r.batch for r in rows] == [2] and rows[0].speedup_vs_fat and rows[0].oracle_ms
    kinds = [json.loads(line)["kind"] for line in results.read_text().splitlines()]
    assert kinds[0] == "run" and "capacity" in kinds and "profile" in kinds
    assert (tmp_path / "summary.md").exists() and (tmp_path / "latency.png").exists()
    # the server the bench started is gone, and no version directory is left behind
    assert bench.server is None
    assert not list((tmp_path / "model-store").glob("noop.p*"))


def test_bench_tuned_configurations_on_a_tiny_model_with_two_modes(
        tmp_path: Path, shared_torchserve: RunningServer) -> None:
    """One tune per model (fp32-eager, the archive's own, and fp32-torchscript), then fat-tuned
    (fat's shape in the mode tuned for B) and tuned (the tuned (mode, plan)) measured beside fat."""
    from packrat.bench.report import write_report
    from packrat.bench.results import read_records

    settings = BenchSettings(
        models=("tiny-bert",), batches=(2,), out=tmp_path, requests=20, max_point_s=30.0, settle_s=1.0,
        profile_budget_s=30.0, profile_point_budget_s=1.0, capacity=False, progress=False, command="test",
        configs=("fat", "fat-tuned", "tuned"), tune=True, tune_modes=("fp32-torchscript",),
        tune_budget_s=120.0, tune_point_budget_s=1.0, attach=shared_torchserve.workdir,
    )
    assert settings.tuning
    results = Bench(settings).run()
    records = list(read_records(results))
    (tune,) = [r for r in records if r["kind"] == "tune"]
    assert tune["state"] == "done", tune
    # The bench's own profile of the archive's mode is reused by the tune; the other mode is
    # guarded and profiled.
    assert tune["modes"]["fp32-eager"]["state"] == "reused", tune["modes"]
    assert tune["modes"]["fp32-torchscript"]["state"] == "profiled", tune["modes"]
    assert tune["batch"] == 2

    ms = {m.config: m for m in read_measurements(results)}
    assert set(ms) == {"fat", "fat-tuned", "tuned"}
    for m in ms.values():
        assert m.load["ok"] == 20 and m.load["errors"] == 0, m
    fat, fat_tuned, tuned = ms["fat"], ms["fat-tuned"], ms["tuned"]
    assert fat.mode == "fp32-eager" and fat.instances == ((2, 2),)
    # Both modes planned at B=2 from their profiles; tuned is the lower prediction, ties to the
    # archive's own mode (listed first), and fat-tuned runs fat's shape in that same mode.
    per_mode = {r["mode"]: r["predicted_ms"] for r in tuned.extra["per_mode"]}
    assert set(per_mode) == {"fp32-eager", "fp32-torchscript"}
    best = min(per_mode, key=lambda k: (per_mode[k], k != "fp32-eager"))
    assert tuned.mode == fat_tuned.mode == best
    assert fat_tuned.instances == ((2, 2),) and tuned.predicted_ms == pytest.approx(per_mode[best], abs=1e-3)
    # Every plan went live through the controller's swap in its own mode: the swap history
    # holds each (mode, shape) a measurement ran in.
    swaps = [json.loads(line) for line in (tmp_path / "controller" / "swaps.jsonl").read_text().splitlines()]
    applied = {(s["plan"].get("mode") or "fp32-eager", tuple((w["threads"], w["batch"]) for w in s["plan"]["instances"]))
               for s in swaps if s.get("outcome") == "applied"}
    for m in (fat, fat_tuned, tuned):
        assert (m.mode, m.instances) in applied or m.extra["swap"] == "none: shape already live", (m, applied)

    (row,) = summarise(read_measurements(results))
    assert row.mode_gain == pytest.approx(fat.p50 / fat_tuned.p50)
    assert row.shape_gain == pytest.approx(fat_tuned.p50 / tuned.p50)
    assert row.total_gain == pytest.approx(fat.p50 / tuned.p50)
    md = write_report(results, chart=False)["summary_md"].read_text()
    assert "## Mode gain x shape gain (tuned)" in md and "- tiny-bert: done in" in md
    # attached: the archive went into the server's store; no version directory is left, nothing
    # stays registered, and the server still runs
    store = shared_torchserve.model_store
    assert not list(store.glob("tiny-bert.p*"))
    assert no_models_left(shared_torchserve) == [] and shared_torchserve.is_running()
    shutil.rmtree(store / "tiny-bert")  # the base archive the bench built there
    assert archives_left(shared_torchserve) == []
