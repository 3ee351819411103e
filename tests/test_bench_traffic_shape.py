"""The traffic-shape benchmark (packrat.bench.traffic_shape, scripts/bench_traffic_shape.py).

The table's arithmetic on hand-made records (ratios, spreads, the target's band), the texts
of each phase, then one short live run on the suite's tiny text archive: a real TorchServe,
`packrat controller --no-tune` and 8 closed-loop clients through one A and one B phase, too
short for the controller to settle (marked so), whose records carry every field and no
failed request. No speed is asserted: the machine is shared. The live run attaches to the
TorchServe the bench modules share (bench_support) and leaves it as it found it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from packrat.bench.results import read_records
from packrat.bench.traffic_shape import PHASES, SHORT_TEXTS, Options, long_texts, phases, render, run, verdicts
from packrat.profile.store import save_profile
from packrat.server import RunningServer
from packrat.types import Profile, ProfilePoint
from bench_support import archives_left, no_models_left, shared_torchserve  # noqa: F401 (a fixture)

PHASE_FIELDS = ("round", "phase", "texts", "clients", "settled", "settled_after_s", "window_s", "observed",
                "predicted", "ratio", "ratio_corrected", "service_ratio", "predicted_for", "planned_from",
                "traffic", "mode", "plan", "plan_batch", "plan_predicted_ms", "swaps", "swaps_failed",
                "swapped_to", "reprofiles", "requests", "failed", "errors")


def _row(rnd: int, phase: str, p50: float, current: float) -> dict:
    return {"round": rnd, "phase": phase, "texts": PHASES[phase][0], "predicted_for": {"tokens": 6},
            "plan": "1x(2t,b8)", "settled": True, "settled_after_s": 30.0, "swaps": 1, "reprofiles": [],
            "failed": 0, "ratio": round(p50 / current, 3), "service_ratio": 1.0,
            "observed": {"p50_ms": p50, "p99_ms": 2 * p50, "throughput_rps": 10.0},
            "predicted": {"current_ms": current, "corrected_current_ms": current, "estimated_batch": 8}}


def test_verdict_is_within_25_percent_or_the_noise_band() -> None:
    rows = [_row(1, "A", 20.0, 10.0), _row(1, "B", 110.0, 100.0),
            _row(2, "A", 30.0, 10.0), _row(2, "B", 115.0, 100.0)]
    a, b = verdicts(rows)
    assert a["ratio"] == 2.5 and a["p50_spread"] == 0.4 and a["band"] == 0.4 and a["within"] is False
    assert b["ratio"] == 1.125 and b["band"] == 0.25 and b["within"] is True  # spread 0.044 < 25 %
    run_rec = {"kind": "run", "machine": "AMD EPYC, 2 cores", "command": "python x"}
    round_trip = {"kind": "round-trip", "p50_ms": 0.4, "p99_ms": 1.5}
    text = render([run_rec, round_trip] + [{"kind": "phase", **r} for r in rows], (0.0, 60.0))
    assert text.startswith("---\ndate: 1970-01-01 00:00-00:01 UTC\nmachine: AMD EPYC, 2 cores\n")
    assert "outside" in text.split("---")[1] and text.count("| 1x(2t,b8) B=8 |") == 4
    assert "p50 0.4 ms, p99 1.5 ms" in text


def test_phases_send_short_and_long_texts(tiny_store: Path) -> None:
    assert all(len(t.split()) <= 4 for t in SHORT_TEXTS)  # <= 8 tokens with [CLS] and [SEP]
    assert {len(t.split()) for t in long_texts()} == {120} and len(set(long_texts())) == len(long_texts())
    fitted = phases(tiny_store / "tiny-bert")["B"][1]  # tiny-bert takes at most 64 tokens
    assert all(40 <= len(t.split()) < 64 for t in fitted), [len(t.split()) for t in fitted]


@pytest.mark.torchserve
def test_a_short_live_run_records_every_field(tiny_store: Path, tmp_path: Path,
                                              shared_torchserve: RunningServer) -> None:
    start = Profile(model_id="tiny-bert", points=tuple(
        ProfilePoint(threads=t, batch=b, mean_ms=2.0 * b / t) for t in (1, 2) for b in (1, 2, 4, 8)),
        extra={"settings": {"sizes": [["tokens", 128]], "max_batch": 4, "cores": 1, "budget_s": 10.0}})
    save_profile(start, tmp_path / "start.json")
    out = tmp_path / "traffic-shape-tiny.jsonl"
    # Each phase: at most 2 s waiting to settle (the estimator is not ready that soon: marked
    # unsettled) and a 2 s window (2 ticks polled); only the records' fields are checked.
    rows = run(Options(model_dir=tiny_store / "tiny-bert", out_jsonl=out, start_profile=tmp_path / "start.json",
                       rounds=1, window_s=2.0, settle_timeout_s=2.0, hold_s=1.0, round_trip_s=0.5,
                       attach=shared_torchserve.workdir, command="test"))
    # attached: the model unregistered, its link and versions gone, the server still serving
    assert no_models_left(shared_torchserve) == [] and shared_torchserve.is_running()
    assert archives_left(shared_torchserve) == []
    assert (tiny_store / "tiny-bert" / "model_config.yaml").is_file()  # the linked archive itself kept
    assert [(r["round"], r["phase"]) for r in rows] == [(1, "A"), (1, "B")]
    for r in rows:
        assert set(PHASE_FIELDS) <= set(r), set(PHASE_FIELDS) - set(r)
        assert r["failed"] == 0 and r["requests"] > 0, r["errors"]
        # a window on a loaded machine may see nothing answered: then no latency, not 0 ms
        answered = r["observed"]["requests"] - r["observed"]["failed"]
        assert (r["observed"]["p50_ms"] or 0) > 0 if answered else r["observed"]["p50_ms"] is None
        # the start profile (128 tokens), or the Reprofiler's at the short texts once it ran
        if r["planned_from"] == "profiles/tiny-bert.json":
            assert r["predicted_for"] == {"tokens": 128}
        else:
            assert r["planned_from"] == f"profiles/tiny-bert/{r['mode']}.json"
            assert any(x["reprofiles"] for x in rows[:rows.index(r) + 1])  # one of this phase or before
            assert r["predicted_for"]["tokens"] <= 8
    # what the live workers counted (None: workers just swapped in, nothing counted yet); in
    # phase A only short texts were sent
    assert rows[0]["traffic"] is None or 0 < rows[0]["traffic"]["p90"] <= 8
    kinds = [r["kind"] for r in read_records(out)]
    assert kinds == ["run", "start-profile", "round-trip", "phase", "phase", "end"]
    assert next(r for r in read_records(out) if r["kind"] == "round-trip")["failed"] == 0


def test_the_plot_draws_every_phase(tmp_path: Path) -> None:
    from packrat.bench.traffic_shape import plot

    rows = [_row(1, "A", 20.0, 10.0), _row(1, "B", 110.0, 100.0), _row(2, "A", 30.0, 10.0)]
    path = tmp_path / "shape.png"
    plot([{"kind": "run"}] + [{"kind": "phase", **r} for r in rows], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    text = render([{"kind": "run", "machine": "m", "command": "c"}] + [{"kind": "phase", **r} for r in rows],
                  (0.0, 60.0), "traffic-shape-x.png")
    assert text.rstrip().endswith("(traffic-shape-x.png)")
