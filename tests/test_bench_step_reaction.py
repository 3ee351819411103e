"""The step-load benchmark (packrat.bench.step_reaction, scripts/bench_step_reaction.py).

The figures come from the trace: a hand-made trace pins each one (times from the swap
records, throughput from the clients' counts); then one short live run of the two-model
scenario through a real TorchServe and the controller's own loop (two copies of the
table-latency sleep model) yields a row per model and phase whose figures are the trace's,
rendered into markdown and a plot. No speed is asserted: the machine is shared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packrat.bench.step_reaction import SCENARIOS, WINDOWS_S, analyse, live_at, run, sleep_models
from packrat.bench.step_report import plot, render_md, trace_and_render


def _req(start: float, end: float, status: int = 200) -> list:
    return [start, end, status]


def _swap(model: str, started_at: float, ready_s: float, shape: list[tuple[int, int]],
          outcome: str = "applied") -> dict:
    return {"model": model, "started_at": started_at, "outcome": outcome,
            "phases_s": {"create": 0.5, "register": 0.5, "ready": ready_s, "set_default": 0.5, "drain": 2.0},
            "plan": {"instances": [{"threads": t, "batch": b} for t, b in shape]}}


def hand_trace() -> dict:
    """Model m: 1 client over [100, 130), 8 over [130, 160). Phase 1: 2 answers/s until the
    swap's plan serves at 136 (started 133: 0.5 + 0.5 + 1.5 + 0.5 s), 5/s after, one failure."""
    phase0 = [_req((1005 + 5 * k) / 10 - 0.1, (1005 + 5 * k) / 10) for k in range(59)]  # ends 100.5..129.5
    slow = [_req(e - 0.1, e) for e in ((1302.5 + 5 * k) / 10 for k in range(12))]  # ends 130.25..135.75
    fast = [_req(e - 0.1, e) for e in ((1361 + 2 * k) / 10 for k in range(120))]  # ends 136.1..159.9
    return {
        "level_changes": {"m": [[100.0, 1], [130.0, 8], [160.0, 0]]},
        "requests": {"m": phase0 + slow + [_req(140.0, 140.05, 503)] + fast},
        "swaps": [_swap("m", 90.0, 1.5, [(2, 1)]), _swap("m", 133.0, 1.5, [(1, 4), (1, 4)])],
        "decisions": [{"model": "m", "time_s": 120.0, "swap": False, "reason": "same-plan"},
                      {"model": "m", "time_s": 132.0, "swap": True, "reason": "swap"},
                      {"model": "m", "time_s": 150.0, "swap": False, "reason": "same-plan"}],
    }


def test_figures_come_from_the_swap_records_and_the_clients_counts() -> None:
    start, step = analyse(hand_trace(), settled_s=10.0)
    assert live_at(hand_trace()["swaps"][1]) == 136.0
    assert start == {
        "model": "m", "phase": 0, "clients": 1, "duration_s": 30.0, "swap_decided_after_s": None,
        "first_swap_live_after_s": None, "right_plan_live_after_s": 0.0, "plan_at_end": [[2, 1]],
        "last_reason": "same-plan",
        "settled_over_s": 10.0, "settled_rps": 2.0,
        "first_10s_rps": 1.9, "first_10s_of_settled": 0.95, "first_30s_rps": 1.97,
        "first_30s_of_settled": 0.983, "first_60s_rps": None, "first_60s_of_settled": None,
        "swaps": 0, "swaps_failed": 0, "requests": 59, "failed": 0,
    }
    assert step == {
        "model": "m", "phase": 1, "clients": 8, "duration_s": 30.0, "swap_decided_after_s": 2.0,
        "first_swap_live_after_s": 6.0, "right_plan_live_after_s": 6.0, "plan_at_end": [[1, 4], [1, 4]],
        "last_reason": "same-plan",
        # the last 10 s: 50 answers; the first 10: 12 slow + 20 fast; 30 s: 12 + 120
        "settled_over_s": 10.0, "settled_rps": 5.0,
        "first_10s_rps": 3.2, "first_10s_of_settled": 0.64, "first_30s_rps": 4.4,
        "first_30s_of_settled": 0.88, "first_60s_rps": None, "first_60s_of_settled": None,
        "swaps": 1, "swaps_failed": 0, "requests": 133, "failed": 1,
    }


def test_a_swap_running_or_failed_at_the_phase_end_is_no_right_plan() -> None:
    tr = hand_trace()
    tr["swaps"].append(_swap("m", 158.0, 5.0, [(2, 8)]))  # serves at 164.5, after the phase
    step = analyse(tr, settled_s=10.0)[1]
    assert (step["right_plan_live_after_s"], step["swaps"], step["plan_at_end"]) == (None, 2, [[1, 4], [1, 4]])
    tr = hand_trace()
    tr["swaps"][1]["outcome"] = "failed"
    step = analyse(tr, settled_s=10.0)[1]
    assert (step["right_plan_live_after_s"], step["swaps_failed"], step["plan_at_end"]) == (None, 1, [[2, 1]])
    # a swap of another model is not this one's
    tr = hand_trace()
    tr["swaps"][1]["model"] = "other"
    assert analyse(tr, settled_s=10.0)[1]["right_plan_live_after_s"] == 0.0


def test_render_reads_the_rows(tmp_path: Path) -> None:
    tr = hand_trace()
    tr.update(scenario="one", created="2026-12-04T19:00:00Z", command="python scripts/bench_step_reaction.py",
              phase_s=30.0, models=[{"name": "m", "kind": "sleep"}],
              machine={"cpu": "Some CPU", "cores": 2, "loadavg_start": 1.0, "loadavg_end": 2.0},
              settings={"tick_s": 1.0, "estimator": {"window_s": 5.0},
                        "policy": {"gain_threshold": 0.1, "min_dwell_s": 60.0, "dwell_power": 2.0,
                                   "max_swaps_per_window": 2, "swap_window_s": 120.0, "min_stable_s": 5.0}})
    text = render_md(tr, analyse(tr, settled_s=10.0), "step-x")
    assert "| m | 1 | 8 | 2 | 6 | 6 | 1/4 + 1/4 | 5 | 3.2 (64 %) | 4.4 (88 %) | – (–) | 1 | 133 | 1 |" in text
    assert "Some CPU" in text and "python scripts/bench_step_reaction.py" in text
    plot(tr, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


@pytest.mark.torchserve
@pytest.mark.slow
def test_two_models_live_rows_are_the_traces(tmp_path: Path) -> None:
    levels, phase_s = SCENARIOS["two"], 12.0
    tr = run(sleep_models(2), levels, phase_s, command="pytest")
    tr["scenario"] = "two"
    (tmp_path / "step-t-trace.json").write_text(json.dumps(tr))
    rows = trace_and_render("step-t", "two", phase_s, 30.0, True, [], [], [], out_dir=tmp_path)
    assert (tmp_path / "step-t.png").exists() and "| sleepy-b | 1 | 8 |" in (tmp_path / "step-t.md").read_text()

    assert [(r["model"], r["phase"], r["clients"]) for r in rows] == [
        (m, k, c) for m, lv in zip(("sleepy", "sleepy-b"), levels) for k, c in enumerate(lv)]
    swaps = tr["swaps"]
    assert swaps and all(s["outcome"] == "applied" for s in swaps)  # at least the two starting plans
    for r in rows:
        (t0, _), (t1, _) = tr["level_changes"][r["model"]][r["phase"]:r["phase"] + 2]
        assert t1 - t0 == pytest.approx(phase_s, abs=1.0)
        mine = [s for s in swaps if s["model"] == r["model"]]
        assert r["swaps"] == sum(1 for s in mine if t0 <= s["started_at"] < t1)
        landed = [live_at(s) for s in mine if t0 <= live_at(s) < t1]
        if r["right_plan_live_after_s"] is not None:
            assert r["right_plan_live_after_s"] == (round(landed[-1] - t0, 1) if landed else 0.0)
        ends = [e for _, e, st in tr["requests"][r["model"]] if st == 200 and t0 <= e < t0 + 10]
        assert r["first_10s_rps"] == round(len(ends) / 10, 2)
        assert r["failed"] == 0
        # a loaded phase is answered; an idle one is not asked
        assert (r["settled_rps"] > 0) == (r["clients"] > 0)
    for w in WINDOWS_S:
        assert all(f"first_{w}s_rps" in r for r in rows)
