"""`packrat bench` end to end on the no-op model: a real TorchServe, real swaps, saved results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packrat.bench.report import summarise
from packrat.bench.results import read_measurements
from packrat.bench.run import Bench, BenchSettings

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]


def test_bench_measures_every_configuration_and_leaves_nothing_registered(tmp_path: Path) -> None:
    settings = BenchSettings(
        models=("noop",), batches=(2,), out=tmp_path, requests=30, max_point_s=30.0,
        profile_budget_s=30.0, profile_point_budget_s=1.0, capacity=True, capacity_requests=50,
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
