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


def _mode_profile(mode: str, per_item_ms: float, two_thread_speedup: float) -> Profile:
    from packrat.types import Fingerprint

    fp = Fingerprint("cpu", 2, "glibc", "2.13.0", mode)
    pts = tuple(ProfilePoint(threads=t, batch=b, mean_ms=per_item_ms * b / (two_thread_speedup if t == 2 else 1.0))
                for t in (1, 2) for b in (1, 2, 4, 8))
    return Profile(model_id="synthetic", points=pts, fingerprint=fp)


def test_tuned_pair_is_the_best_mode_and_fat_in_that_mode() -> None:
    from packrat.bench.tuned import tuned_pair
    from packrat.errors import PlanError

    # fp32-eager: 10 ms/item, 2 threads 1.2x; bf16-openvino: 3 ms/item, 2 threads 1.9x.
    slow, fast = _mode_profile("fp32-eager", 10.0, 1.2), _mode_profile("bf16-openvino", 3.0, 1.9)
    pair = tuned_pair([slow, fast], 2, 8)
    # bf16-openvino wins: thin 2x(1t,b4) = 12 ms beats its fat 24/1.9 = 12.6 ms and every fp32 plan
    assert pair.mode == "bf16-openvino" and pair.tuned.mode == "bf16-openvino"
    assert pair.tuned.shape == ((1, 4), (1, 4)) and pair.tuned.predicted_latency_ms == pytest.approx(12.0)
    # fat-tuned: fat's shape in the same mode, predicted from that mode's profile (not fp32's)
    assert pair.fat.mode == "bf16-openvino" and pair.fat.shape == ((2, 8),)
    assert predicted(pair.fat) == pytest.approx(24.0 / 1.9)
    assert [r["mode"] for r in pair.per_mode] == ["fp32-eager", "bf16-openvino"]
    assert pair.per_mode[0]["predicted_ms"] == pytest.approx(40.0)
    # A mode whose 2-thread points scale well keeps fat's shape: tuned == fat-tuned's shape
    wide = _mode_profile("bf16-openvino", 3.0, 2.5)
    pair = tuned_pair([slow, wide], 2, 8)
    assert pair.tuned.shape == pair.fat.shape == ((2, 8),)
    # Ties go to the profile listed first (the archive's own mode, as in the tune)
    twin = _mode_profile("fp32-torchscript", 10.0, 1.2)
    assert tuned_pair([slow, twin], 2, 8).mode == "fp32-eager"
    assert tuned_pair([twin, slow], 2, 8).mode == "fp32-torchscript"
    # B beyond every profiled batch on 2 cores: no plan in any mode
    with pytest.raises(PlanError, match="no mode has a plan for B=32"):
        tuned_pair([slow, fast], 2, 32)
    with pytest.raises(PlanError):
        tuned_pair([], 2, 8)


def test_tuning_defaults_per_mode_and_cli_checks(tmp_path: Path) -> None:
    from packrat.bench.run import full_settings

    quick, full = quick_settings(tmp_path), full_settings(tmp_path)
    assert not quick.tuning and full.tuning and full.tune_budget_s == 360.0
    assert {"fat-tuned", "tuned"} <= set(full.configs)
    assert not full_settings(tmp_path, tune=False).tuning
    assert not full_settings(tmp_path, configs=("fat", "packrat")).tuning  # nothing tuned to measure
    s = BenchSettings(models=("x",), batches=(2,), out=tmp_path, cores=(0, 1), tune=True)
    assert s.tuning
    runner = CliRunner()
    r = runner.invoke(app, ["bench", "-m", "tiny-bert", "-b", "1", "--configs", "fat,tuned", "--no-tuned",
                            "--out", str(tmp_path)])
    assert r.exit_code == 2 and "need tuning" in r.output
    r = runner.invoke(app, ["bench", "-m", "tiny-bert", "-b", "1", "--tuned", "--tune-mode", "fp16-eager",
                            "--out", str(tmp_path)])
    assert r.exit_code == 2 and "unknown mode" in r.output
