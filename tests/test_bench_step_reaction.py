"""The step-load benchmark (packrat.bench.step_reaction, scripts/bench_step_reaction.py).

The figures come from the trace: a hand-made trace pins each one (times from the swap
records, throughput from the clients' counts); then one short live run of the two-model
scenario through a real TorchServe and the controller's own loop (two copies of the
table-latency sleep model) yields a row per model and phase whose figures are the trace's,
rendered into markdown and a plot. No speed is asserted: the machine is shared.
The alternate scenario's per-model figures (swaps in a sliding window, seconds below the
share while loaded) are pinned the same way on a hand-made trace, then read from a live run:
the same one (module fixture), since the two-model levels are the alternate scenario's over
three phases; one controller start for both, on the TorchServe the bench modules share
(bench_support): the run attaches to it and leaves it as it found it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from packrat.bench.step_reaction import (
    SCENARIOS, WINDOWS_S, alternate_rows, analyse, live_at, max_in_window, run, scenario_levels, sleep_models,
)
from packrat.bench.step_report import plot, render_alternate_md, render_md, trace_and_render
from packrat.server import RunningServer
from bench_support import archives_left, no_models_left, shared_torchserve  # noqa: F401 (a fixture)


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


# A phase outlasts the first 10 s window (first_10s_rps is None in a shorter phase); a level
# holds at least phase_s (the load's driver waits it out), 0.5 s spare.
LIVE_PHASE_S = 10.5


@pytest.fixture(scope="module")
def live_trace(shared_torchserve: RunningServer) -> dict:
    """One live run of the two-model levels (module doc); each test reads its own copy."""
    trace = run(sleep_models(2), SCENARIOS["two"], LIVE_PHASE_S, command="pytest", server=shared_torchserve)
    # attached: both models and their versions gone again, the server still serving
    assert no_models_left(shared_torchserve) == [] and shared_torchserve.is_running()
    assert archives_left(shared_torchserve) == []
    return trace


@pytest.mark.torchserve
@pytest.mark.slow
def test_two_models_live_rows_are_the_traces(live_trace: dict, tmp_path: Path) -> None:
    levels, phase_s = SCENARIOS["two"], LIVE_PHASE_S
    tr = copy.deepcopy(live_trace)
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


# -- the alternate scenario ----------------------------------------------------------------


def _aswap(model: str, started_at: float, cores: int, outcome: str = "applied") -> dict:
    """Serves 3 s after it starts (0.5 + 0.5 + 1.5 + 0.5)."""
    sw = _swap(model, started_at, 1.5, [(1, 4)] * cores, outcome)
    sw["plan"]["cores"] = cores
    return sw


def alternate_trace() -> dict:
    """a has clients over [100, 105) and [110, 115); b over [104.5, 110) and [115, 120): both
    over [104.5, 105), where each one's share is 1 core (alone: 2). a's live plan: 2 cores,
    1 from 104 (swap started 101), 2 again from 114 (started 111); b stays on 2. The
    division gave a 1 core until the sample at 102."""
    ok = [_req(e - 0.2, e) for e in (100.5, 101.5, 102.5, 103.5, 104.5, 110.5, 111.5, 112.5, 113.5, 114.5)]
    return {
        "level_changes": {"a": [[100.0, 8], [105.0, 0], [110.0, 8], [115.0, 0], [120.0, 0]],
                          "b": [[100.0, 0], [104.5, 8], [110.0, 0], [115.0, 8], [120.0, 0]]},
        "requests": {"a": ok + [_req(105.0, 105.2), _req(111.9, 112.0, 503)],  # 105.2: a idle then
                     "b": [_req(e - 0.2, e) for e in (105.5, 106.5, 107.5, 108.5, 109.5,
                                                     115.5, 116.5, 117.5, 118.5, 119.5)]},
        "swaps": [_aswap("a", 90.0, 2), _aswap("b", 91.0, 2), _aswap("a", 101.0, 1), _aswap("a", 111.0, 2),
                  _aswap("a", 125.0, 1)],  # after the load: not counted
        "decisions": [{"model": "a", "time_s": 100.5, "swap": True, "reason": "cores-moved"},
                      {"model": "a", "time_s": 110.5, "swap": True, "reason": "gain"},
                      {"model": "b", "time_s": 106.0, "swap": False, "reason": "same-plan"}],
        "shares": {"batch": 8, "alone": {"a": 2, "b": 2}, "all": {"a": 1, "b": 1}},
        "division": [[99.0, {"a": 1, "b": 1}], [102.0, {"a": 2, "b": 2}]],
    }


def test_swaps_in_a_sliding_window_not_in_fixed_minutes() -> None:
    # minutes [0, 60) and [60, 120) hold 1 and 2; the window [50, 110) holds all 3
    assert max_in_window([50.0, 70.0, 100.0], 60.0) == 3
    # half-open: 60 is not in [0, 60), and [60, 120) holds only 60
    assert max_in_window([0.0, 60.0], 60.0) == 1
    assert max_in_window([0.0, 30.0, 59.9, 60.0, 119.0], 60.0) == 3
    assert max_in_window([], 60.0) == 0


def test_alternate_levels_move_the_eight_clients_every_phase() -> None:
    first, second = scenario_levels("alternate", 5.0, 300.0)
    assert len(first) == 60 and first[:3] == [8, 0, 8] and second[:3] == [0, 8, 0]
    assert all(a + b == 8 and a * b == 0 for a, b in zip(first, second))
    assert scenario_levels("two", 90.0) == SCENARIOS["two"]


def test_alternate_figures_time_below_share_while_loaded() -> None:
    a, b = alternate_rows(alternate_trace())
    assert a == {
        "model": "a", "load_s": 20.0, "loaded_s": 10.0,
        "swaps": 2, "swaps_failed": 0, "swaps_per_min": 6.0,  # 2 in 20 s
        "max_swaps_60s": 2, "max_swaps_120s": 2,
        "swap_reasons": {"cores-moved": 1, "gain": 1},
        "share_alone": 2, "share_all": 1,
        # [100, 104) 2 cores, [104, 105) 1, [110, 114) 1, [114, 115) 2
        "live_cores_s": {"1": 5.0, "2": 5.0},
        # 1 core below 2 over [104, 104.5) and [110, 114); over [104.5, 105) b has clients too: share 1
        "below_share_s": 4.5,
        # the division gave 1 core over [100, 102)
        "division_below_share_s": 2.0,
        # the division gave 2 from 102: the 1-core plan lags it over [104, 105) and [110, 114)
        "below_division_s": 5.0,
        "answered_rps_loaded": 1.0,  # 10 answers ending while a had clients, over 10 s (105.2 is not)
        "requests": 12, "failed": 1,
    }
    assert (b["loaded_s"], b["swaps"], b["max_swaps_60s"], b["below_share_s"], b["division_below_share_s"],
            b["below_division_s"], b["live_cores_s"], b["answered_rps_loaded"], b["failed"]) == (
        10.5, 0, 0, 0.0, 0.0, 0.0, {"2": 10.5}, 0.95, 0)


def test_alternate_failed_swap_leaves_the_old_plan_live() -> None:
    tr = alternate_trace()
    tr["swaps"][2]["outcome"] = "failed"  # a stays on 2 cores until 114, where 2 land again
    a = alternate_rows(tr)[0]
    assert (a["swaps"], a["swaps_failed"], a["below_share_s"], a["live_cores_s"]) == (2, 1, 0.0, {"2": 10.0})


def test_alternate_page_states_the_targets_as_measured(tmp_path: Path) -> None:
    tr = alternate_trace()
    tr.update(scenario="alternate", created="2026-12-05T02:00:00Z", command="python x.py", phase_s=5.0,
              models=[{"name": "a", "kind": "sleep"}, {"name": "b", "kind": "sleep"}],
              machine={"cpu": "AMD EPYC", "cores": 2, "loadavg_start": 1.0, "loadavg_end": 2.0},
              settings={"tick_s": 1.0, "estimator": {"window_s": 5.0},
                        "policy": {"gain_threshold": 0.1, "min_dwell_s": 60.0, "dwell_power": 2.0,
                                   "max_swaps_per_window": 2, "swap_window_s": 120.0, "min_stable_s": 5.0}})
    text = render_alternate_md(tr, alternate_rows(tr), "step-alt")
    assert "machine: AMD EPYC, 2 cores" in text
    assert ("| a | 10 | 2 | 6 | 2 | 2 | cores-moved: 1, gain: 1 | 2 / 1 | 1: 5, 2: 5 | 4.5 | 2 | 5 | 1 | 12 | 1 |"
            in text)
    assert "≤ 1 swap per model per minute: missed (most in a sliding 60 s window: 2" in text
    assert "- 0.5 s, `a`: cores-moved" in text and "- 10.5 s, `a`: gain" in text
    (tmp_path / "step-alt-trace.json").write_text(json.dumps(tr))
    rows = trace_and_render("step-alt", "alternate", 5.0, 30.0, True, [], [], [], out_dir=tmp_path)
    assert [r["model"] for r in rows] == ["a", "b"]
    assert (tmp_path / "step-alt.png").stat().st_size > 10_000
    assert (tmp_path / "step-alt.md").read_text() == text


@pytest.mark.torchserve
@pytest.mark.slow
def test_alternate_live_rows_are_the_traces(live_trace: dict, tmp_path: Path) -> None:
    phase_s = LIVE_PHASE_S
    levels = scenario_levels("alternate", phase_s, 3 * phase_s)
    assert levels == SCENARIOS["two"]  # the shared run is an alternate one of three phases
    tr = copy.deepcopy(live_trace)
    tr["scenario"] = "alternate"
    (tmp_path / "step-a-trace.json").write_text(json.dumps(tr))
    rows = trace_and_render("step-a", "alternate", phase_s, 30.0, True, [], [], [], out_dir=tmp_path)
    assert (tmp_path / "step-a.png").exists() and "| sleepy-b |" in (tmp_path / "step-a.md").read_text()
    # the sleep model gains from its second core: loaded alone it gets both, with the other loaded one
    assert tr["shares"] == {"batch": 8, "alone": {"sleepy": 2, "sleepy-b": 2}, "all": {"sleepy": 1, "sleepy-b": 1}}
    assert tr["division"] and all(set(d) == {"sleepy", "sleepy-b"} for _, d in tr["division"])
    t0 = min(ch[0][0] for ch in tr["level_changes"].values())
    for r, lv in zip(rows, levels):
        assert r["loaded_s"] == pytest.approx(phase_s * sum(1 for c in lv if c), abs=1.0)  # its loaded phases
        assert sum(r["live_cores_s"].values()) == pytest.approx(r["loaded_s"], abs=0.1)
        mine = [s for s in tr["swaps"] if s["model"] == r["model"] and s["started_at"] >= t0]
        assert r["swaps"] == len(mine) and r["failed"] == 0 and r["answered_rps_loaded"] > 0
