"""The benchmark driver's pure parts: candidate shapes, request counts, CLI argument errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from packrat.bench.run import BenchSettings, predicted, quick_settings, server_side
from packrat.cli import app
from packrat.plan import every_uniform_plan
from packrat.types import Observation, Profile, ProfilePoint


def _profile() -> Profile:
    # L(t, b) = 10 * b / t ms for t in 1..2, b in 1, 2, 4, 8
    pts = tuple(ProfilePoint(threads=t, batch=b, mean_ms=10.0 * b / t) for t in (1, 2) for b in (1, 2, 4, 8))
    return Profile(model_id="synthetic", points=pts)


def test_candidates_are_the_uniform_shapes_fat_first() -> None:
    shapes = [p.shape for p in every_uniform_plan(2, 8, _profile())]
    # i = 1: 1 worker x 2 threads x cap 8 (fat); i = 2: 2 workers x 1 thread x cap 4
    assert shapes == [((2, 8),), ((1, 4), (1, 4))]
    # B = 1 admits one worker only; B = 3 on 2 cores: caps ceil(3/2) = 2
    assert [p.shape for p in every_uniform_plan(2, 1, None)] == [((2, 1),)]
    assert [p.shape for p in every_uniform_plan(2, 3, None)] == [((2, 3),), ((1, 2), (1, 2))]


def test_candidate_predictions_come_from_the_profile() -> None:
    fat, thin = every_uniform_plan(2, 8, _profile())
    assert predicted(fat) == pytest.approx(10.0 * 8 / 2)  # L(2, 8)
    assert predicted(thin) == pytest.approx(10.0 * 4 / 1)  # L(1, 4)
    assert fat.fat_latency_ms == pytest.approx(40.0)
    # unprofiled cap (3) -> no prediction rather than a guess
    assert predicted(every_uniform_plan(2, 3, _profile())[0]) is None


def test_request_counts_scale_with_load() -> None:
    s = BenchSettings(models=("x",), batches=(1, 32), out=Path("o"), min_requests=60, rounds=8, warmup_rounds=2)
    # measured = max(min_requests, rounds x B); warm-up = max(warmup_rounds x B, 4)
    assert s.point_requests(1) == (60, 4)  # min 60 measured; warm-up at least 4
    assert s.point_requests(32) == (256, 64)  # 8 rounds x 32, 2 rounds x 32
    assert BenchSettings(models=("x",), batches=(1,), out=Path("o"), requests=10).point_requests(32)[0] == 10
    assert quick_settings(Path("o")).batches == (1, 4, 8)


def test_cli_rejects_bad_arguments(tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["bench", "--quick", "--full", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "exclude" in r.output
    r = runner.invoke(app, ["bench", "-m", "tiny-bert", "-b", "1,x", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--batches" in r.output
    r = runner.invoke(app, ["bench", "-m", "tiny-bert", "--out", str(tmp_path)])
    assert r.exit_code == 2
    r = runner.invoke(app, ["bench-report", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 2
    r = runner.invoke(app, ["bench", "-m", "tiny-bert", "-b", "1", "--configs", "fat,thin", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--configs" in r.output and "thin" in r.output


def test_bench_load_cli_drives_a_loopback_server(tmp_path: Path) -> None:
    import json

    from packrat.bench.localserver import LocalServer

    srv = LocalServer(0)
    srv.start_in_thread()
    try:
        (tmp_path / "key_file.json").write_text(json.dumps({
            "management": {"key": "m"}, "inference": {"key": "inf-key"}, "API": {"key": "a"}}))
        r = CliRunner().invoke(app, ["bench-load", f"http://127.0.0.1:{srv.port}/p", "-c", "3", "-n", "30",
                                     "--warmup", "0", "--key-file", str(tmp_path / "key_file.json")])
        assert r.exit_code == 0, r.output
        summary = json.loads(r.output)
        assert summary["ok"] == 30 and summary["clients"] == 3
        assert set(srv.auth_seen) == {"Bearer inf-key"}
    finally:
        srv.shutdown()
        srv.server_close()


def test_measure_order_spreads_the_loads() -> None:
    from packrat.bench.run import measure_order

    # middle (index 3 of 6 -> 8), largest, smallest, then the rest from large to small
    assert measure_order((1, 2, 4, 8, 16, 32)) == [8, 32, 1, 16, 4, 2]
    assert measure_order((1, 4, 8)) == [4, 8, 1]
    assert measure_order((2, 1)) == [2, 1]


def test_server_side_split_comes_from_counter_deltas() -> None:
    before = Observation(time_s=0.0, model="m", requests_total=10, latency_us_total=1_000_000,
                         queue_latency_us_total=100_000)
    after = Observation(time_s=5.0, model="m", requests_total=30, latency_us_total=3_000_000,
                        queue_latency_us_total=500_000)
    # 20 requests: 2 s of latency -> 100 ms mean, of which 0.4 s queue -> 20 ms, worker 80 ms
    assert server_side(before, after) == {"requests": 20, "mean_ms": 100.0, "queue_ms": 20.0, "worker_ms": 80.0}
    assert server_side(before, before) is None  # no request in between
    assert server_side(None, after) is None
    no_queue = Observation(time_s=5.0, model="m", requests_total=30, latency_us_total=3_000_000)
    assert server_side(before, no_queue) == {"requests": 20, "mean_ms": 100.0}
