"""Reports are computed from a recorded JSONL only: ratios, regret, gaps, files, torn lines."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from packrat.bench.report import noise_band, repeat_pairs, summarise, verdict, write_report
from packrat.bench.results import Measurement, ResultLog, read_measurements, shape_label


def _load(p50: float, ok: int = 100, errors: int = 0, thr: float = 10.0) -> dict:
    return {"ok": ok, "errors": errors, "p50_ms": p50, "p95_ms": p50 * 1.2, "p99_ms": p50 * 1.5,
            "throughput_rps": thr, "error_kinds": {"http_500": errors} if errors else {}}


def _record(log: ResultLog, model: str, batch: int, config: str, inst: list[tuple[int, int]],
            p50: float, predicted: float | None = None, server: dict | None = None, mode: str | None = None,
            **kw) -> None:
    log.measurement(Measurement(model=model, batch=batch, config=config, shape=shape_label(inst),
                                instances=tuple(inst), predicted_ms=predicted, load=_load(p50, **kw),
                                extra={"server": server} if server else {}, mode=mode))


@pytest.fixture()
def results(tmp_path: Path) -> Path:
    log = ResultLog(tmp_path / "results.jsonl", run_id="t1")
    log.append("run", {"command": "packrat bench --quick", "machine": {"cpu": "test", "cores": 2}})
    # resnet B=8: fat 100, defaults 160, packrat 80 (pred 70), oracle candidates 100, 78, 90
    _record(log, "resnet", 8, "fat", [(2, 8)], 100.0)
    _record(log, "resnet", 8, "defaults", [], 160.0)
    _record(log, "resnet", 8, "packrat", [(1, 4), (1, 4)], 80.0, predicted=70.0)
    _record(log, "resnet", 8, "oracle", [(2, 8)], 100.0)
    _record(log, "resnet", 8, "oracle", [(1, 4), (1, 4)], 78.0)
    # a faster candidate whose requests failed must not become the oracle
    _record(log, "resnet", 8, "oracle", [(1, 8)], 10.0, ok=50, errors=50)
    _record(log, "resnet", 8, "oracle", [(1, 8)], 90.0)  # rerun of that shape: latest wins
    # resnet B=1: packrat only
    _record(log, "resnet", 1, "packrat", [(2, 1)], 20.0, predicted=20.0)
    log.append("capacity", {"target": "noop", "load": {"clients": 4, "throughput_rps": 900.0, "p50_ms": 4.0,
                                                       "p99_ms": 9.0, "generator_cpu_ms_per_request": 0.3,
                                                       "errors": 0}})
    log.append("note", {"model": "resnet", "batch": 16, "text": "skipped: time budget"})
    return log.path


def test_summary_ratios_follow_their_definitions(results: Path) -> None:
    rows = {(r.model, r.batch): r for r in summarise(read_measurements(results))}
    r = rows[("resnet", 8)]
    assert r.speedup_vs_fat == pytest.approx(100.0 / 80.0)  # fat p50 / packrat p50
    assert r.speedup_vs_defaults == pytest.approx(160.0 / 80.0)
    # oracle = fastest valid candidate: 78 (the failed 10 ms one is excluded; its rerun is 90)
    assert r.oracle_ms == 78.0 and r.oracle_shape == "2x(1t,b4)"
    assert r.regret == pytest.approx(80.0 / 78.0 - 1.0)
    assert r.prediction_gap == pytest.approx(80.0 / 70.0 - 1.0)
    one = rows[("resnet", 1)]
    assert one.fat_ms is None and one.speedup_vs_fat is None and one.regret is None
    assert one.prediction_gap == pytest.approx(0.0)


def test_write_report_files(results: Path, tmp_path: Path) -> None:
    paths = write_report(results, tmp_path / "report")
    md = paths["summary_md"].read_text()
    assert "packrat bench --quick" in md
    assert ("| 8 | 100.0 | 160.0 | 80.0 | 2x(1t,b4) | 78.0 | 2x(1t,b4) (=) | 1.25x faster | 2.00x | +2.6 % | 70.0"
            " | +14.3 % | – | – |  |") in md
    # packrat's 2x(1t,b4) and the oracle candidate of that shape are a repeat pair: 80 then 78
    assert "| resnet | 8 | – | 2x(1t,b4) | 80.0 | 78.0 | 2.5 % |" in md
    assert "Mode gain x shape gain" not in md  # no tuned configuration in this run
    assert "skipped: time budget" in md and "| noop | 4 | 900 |" in md
    with open(paths["summary_csv"]) as f:
        summary = list(csv.DictReader(f))
    assert [(r["model"], r["batch"]) for r in summary] == [("resnet", "1"), ("resnet", "8")]
    with open(paths["measurements_csv"]) as f:
        rows = list(csv.DictReader(f))
    # 8 measurement lines, one of them replaced by a rerun of the same shape -> 7 rows
    assert len(rows) == 7
    png = paths["chart"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_torn_last_line_is_ignored(results: Path, tmp_path: Path) -> None:
    before = len(read_measurements(results))
    with open(results, "a") as f:
        f.write('{"kind": "measurement", "model": "res')  # killed mid-write
    assert len(read_measurements(results)) == before
    assert write_report(results, tmp_path / "r2")["summary_md"].exists()


def test_records_are_one_json_object_per_line(results: Path) -> None:
    lines = results.read_text().splitlines()
    kinds = [json.loads(line)["kind"] for line in lines]
    assert kinds[0] == "run" and kinds.count("measurement") == 8
    assert all(json.loads(line)["run_id"] == "t1" for line in lines)


def test_fat_counts_as_the_oracle_candidate_of_its_shape(tmp_path: Path) -> None:
    log = ResultLog(tmp_path / "r.jsonl")
    _record(log, "bert", 4, "fat", [(2, 4)], 50.0)
    _record(log, "bert", 4, "oracle", [(1, 2), (1, 2)], 60.0)
    _record(log, "bert", 4, "packrat", [(2, 4)], 55.0, predicted=45.0)
    (r,) = summarise(read_measurements(log.path))
    # fat's 1x(2t,b4) is the fastest realisable shape measured: oracle 50, regret 55/50 - 1
    assert r.oracle_ms == 50.0 and r.oracle_shape == "1x(2t,b4)"
    assert r.regret == pytest.approx(0.10)


def test_noise_band_is_the_largest_same_shape_difference_and_judges_packrat_vs_fat(tmp_path: Path) -> None:
    log = ResultLog(tmp_path / "r.jsonl")
    # B=8: candidate 2x(1t,b4) 100 then packrat (same shape) 110 -> a 10 % repeat difference
    _record(log, "m", 8, "fat", [(2, 8)], 105.0)
    _record(log, "m", 8, "oracle", [(1, 4), (1, 4)], 100.0)
    _record(log, "m", 8, "packrat", [(1, 4), (1, 4)], 110.0, predicted=100.0,
            server={"mean_ms": 104.0, "queue_ms": 4.0, "worker_ms": 100.0})
    # B=4: packrat 1.2x faster than fat, beyond the 10 % band
    _record(log, "m", 4, "fat", [(2, 4)], 60.0)
    _record(log, "m", 4, "oracle", [(1, 2), (1, 2)], 50.0)
    _record(log, "m", 4, "packrat", [(1, 2), (1, 2)], 50.0, predicted=40.0)
    # B=1: packrat picked fat's own shape
    _record(log, "m", 1, "fat", [(2, 1)], 30.0)
    _record(log, "m", 1, "packrat", [(2, 1)], 33.0)
    ms = read_measurements(log.path)
    pairs = repeat_pairs(ms)
    assert {(p.batch, round(p.diff, 3)) for p in pairs} == {(8, 0.1), (4, 0.0), (1, 0.1)}
    assert noise_band(pairs) == pytest.approx(0.1)
    rows = {r.batch: r for r in summarise(ms)}
    assert rows[1].vs_fat == "same shape"
    assert rows[8].vs_fat == "tie"  # 105/110 is within the band
    assert rows[4].vs_fat == "faster" and rows[4].speedup_vs_fat == pytest.approx(1.2)
    # worker gap: TorchServe's (inference - queue) mean against the prediction, beside the e2e gap
    assert rows[8].worker_ms == 100.0 and rows[8].worker_gap == pytest.approx(0.0)
    assert rows[8].prediction_gap == pytest.approx(0.1)
    assert rows[4].worker_gap is None
    assert rows[8].oracle_shape_match is True


def test_verdict_needs_a_band_and_a_ratio() -> None:
    assert verdict(1.3, None) == "" and verdict(None, 0.1) == ""
    assert verdict(0.85, 0.1) == "slower" and verdict(0.95, 0.1) == "tie" and verdict(1.11, 0.1) == "faster"


BASE, FAST = "fp32-eager", "bf16-openvino"


def test_mode_gain_times_shape_gain_split_per_model_and_b(tmp_path: Path) -> None:
    log = ResultLog(tmp_path / "results.jsonl")
    # B=8: fat 1000 (base mode); oracle/packrat thin in the base mode 1000 / 980 (a 2 % repeat);
    # fat-tuned (fat's shape in bf16-openvino) 250; tuned (thin in bf16-openvino) 200.
    _record(log, "bert", 8, "fat", [(2, 8)], 1000.0, mode=BASE)
    _record(log, "bert", 8, "oracle", [(1, 4), (1, 4)], 1000.0, mode=BASE)
    _record(log, "bert", 8, "packrat", [(1, 4), (1, 4)], 980.0, predicted=950.0, mode=BASE)
    _record(log, "bert", 8, "fat-tuned", [(2, 8)], 250.0, predicted=240.0, mode=FAST)
    _record(log, "bert", 8, "tuned", [(1, 4), (1, 4)], 200.0, predicted=190.0, mode=FAST)
    # B=4: the tuned shape gains 3 %, inside the run's band (5 %, from B=1)
    _record(log, "bert", 4, "fat", [(2, 4)], 500.0, mode=BASE)
    _record(log, "bert", 4, "fat-tuned", [(2, 4)], 103.0, mode=FAST)
    _record(log, "bert", 4, "tuned", [(1, 2), (1, 2)], 100.0, mode=FAST)
    # B=1: the tune kept fat's shape: tuned and fat-tuned are one configuration measured twice
    _record(log, "bert", 1, "fat", [(2, 1)], 100.0, mode=BASE)
    _record(log, "bert", 1, "fat-tuned", [(2, 1)], 40.0, mode=FAST)
    _record(log, "bert", 1, "tuned", [(2, 1)], 42.0, mode=FAST)
    log.append("tune", {"model": "bert", "seconds": 12.5, "state": "done", "error": None, "batch": 8,
                        "budget_s": 60.0, "modes": {BASE: {"state": "reused"}, FAST: {"state": "profiled"},
                                                    "int8-eager": {"state": "refused", "reason": "REFUSED int8"}},
                        "choice": {"mode": FAST, "instances": [{"threads": 1, "batch": 4}] * 2}})
    ms = read_measurements(log.path)
    assert {m.mode for m in ms if m.config in ("fat-tuned", "tuned")} == {FAST}

    # Twins share mode and shape: the thin base-mode oracle is not the thin bf16 tuned plan's twin.
    pairs = repeat_pairs(ms)
    assert {(p.batch, p.mode, round(p.diff, 3)) for p in pairs} == {(8, BASE, 0.02), (1, FAST, 0.05)}
    assert noise_band(pairs) == pytest.approx(0.05)

    rows = {r.batch: r for r in summarise(ms)}
    r = rows[8]
    assert r.mode_gain == pytest.approx(1000.0 / 250.0)  # fat / fat-tuned: the mode alone
    assert r.shape_gain == pytest.approx(250.0 / 200.0)  # fat-tuned / tuned: the shape in that mode
    assert r.total_gain == pytest.approx(1000.0 / 200.0) == pytest.approx(r.mode_gain * r.shape_gain)
    assert (r.fat_mode, r.tuned_mode, r.tuned_shape, r.tuned_predicted_ms) == (BASE, FAST, "2x(1t,b4)", 190.0)
    assert r.vs_fat_tuned == "faster"
    assert r.speedup_vs_fat == pytest.approx(1000.0 / 980.0)  # the base-mode columns are unchanged
    assert rows[4].shape_gain == pytest.approx(1.03) and rows[4].vs_fat_tuned == "tie"
    assert rows[4].mode_gain == pytest.approx(500.0 / 103.0)
    assert rows[1].vs_fat_tuned == "same shape" and rows[1].total_gain == pytest.approx(100.0 / 42.0)

    paths = write_report(log.path, tmp_path / "report", chart=False)
    md = paths["summary_md"].read_text()
    assert "## Mode gain x shape gain (tuned)" in md
    assert ("| 8 | 1000.0 | fp32-eager | 250.0 | bf16-openvino | 2x(1t,b4) | 200.0 | 4.00x | 1.25x | 5.00x"
            " | faster | 190.0 |") in md
    assert "| 1 | 100.0 | fp32-eager | 40.0 | bf16-openvino | 2x(2t,b1) |" not in md
    assert "| 1 | 100.0 | fp32-eager | 40.0 | bf16-openvino | 1x(2t,b1) | 42.0 | 2.50x | 0.95x | 2.38x | same shape" in md
    assert "- bert: done in 12.5 s at B=8" in md and "int8-eager refused (REFUSED int8)" in md
    with open(paths["summary_csv"]) as f:
        summary = {int(row["batch"]): row for row in csv.DictReader(f)}
    assert float(summary[8]["mode_gain"]) == pytest.approx(4.0) and summary[8]["tuned_mode"] == FAST
    with open(paths["measurements_csv"]) as f:
        assert {(row["config"], row["mode"]) for row in csv.DictReader(f) if row["batch"] == "8"} == {
            ("fat", BASE), ("oracle", BASE), ("packrat", BASE), ("fat-tuned", FAST), ("tuned", FAST)}


def test_measurements_without_a_mode_still_read(tmp_path: Path) -> None:
    """Results written before modes were recorded: mode None, same report."""
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"kind": "measurement", "model": "m", "batch": 2, "config": "fat", "shape": "1x(2t,b2)",
                                "instances": [[2, 2]], "predicted_ms": None, "load": _load(10.0)}) + "\n")
    (m,) = read_measurements(path)
    assert m.mode is None and m.config == "fat"
    assert Measurement.from_json({**m.to_json(), "mode": "bf16-openvino", "config": "tuned"}).mode == "bf16-openvino"
