"""The loop closed on a real TorchServe: a closed-loop load steps 1 -> 8 -> 2
clients and the controller follows with the plan for each level.

The model sleeps a table latency per batch (tests/data/observe/sleepmodel) and
its profile is that table, so the expected plans are known and hold even on a
machine busy with other work. Plans for 2 cores (packrat.plan.realizable_plan):
    B=1: 1 worker  x (2 threads, cap 1)    90 ms
    B=2: 2 workers x (1 thread,  cap 1)   120 ms
    B=8: 2 workers x (1 thread,  cap 4)   192 ms
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from packrat.observe.loop import AdaptSettings
from packrat.observe.policy import PolicySettings
from packrat.bench.adapt_rig import Rig, sleep_table, table_profile
from packrat.bench.loadgen import Step, StepLoad
from packrat.plan import realizable_plan, same_shape
from packrat.server import RunningServer
from packrat.types import Plan
from bench_support import archives_left, no_models_left, shared_torchserve  # noqa: F401 (a fixture)
from waiting import wait_until

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]

SLEEP_MODEL = Path(__file__).parent / "data" / "observe" / "sleepmodel"
MODEL = "sleepy"
LEVELS = (1, 8, 2)  # clients: the run starts on the plan for the first
# Each level is held until the loop has settled on its plan, however long that takes
# on a busy machine: B read (~7-10 s) + held 5 s + a swap (5-25 s: two workers
# importing torch on a 2-core machine). SETTLE_S only stops a loop that is stuck.
# How fast adaptation is goes to docs/adaptation.md (scripts/adapt_trace.py).
SETTLE_S = 300.0
SETTLED_TICKS = 3  # consecutive content ticks at the level that count as settled
CONTENT = ("same-plan", "gain-below-threshold")
SETTINGS = AdaptSettings(policy=PolicySettings(min_dwell_s=20.0, use_correction=False))


def _settled(decisions: list[dict], since: float, level: int) -> bool:
    """From some tick after `since` on, B reads `level` and the policy is content with the
    running plan for it: it is the best plan ("same-plan"), or within the gain threshold
    of it once the measured latency gap is taken into account ("gain-below-threshold")."""
    tail = [d for d in decisions if d["time_s"] > since][-SETTLED_TICKS:]
    return len(tail) == SETTLED_TICKS and all(d["estimated_batch"] == level and d["reason"] in CONTENT
                                              for d in tail)


def _decisions(rig: Rig) -> list[dict]:
    return [d for d in list(rig.decision_log) if d.get("model") == MODEL and "reason" in d]


def _switch_off_and_on(rig: Rig, api: str, mgmt: dict) -> None:
    """REST: switch the loop off and on again (the model keeps its plan meanwhile);
    a token is required to switch and to read."""
    r = requests.put(f"{api}/v1/models/{MODEL}/adapt", json={"enabled": False}, headers=mgmt, timeout=10)
    assert r.status_code == 200 and r.json()["enabled"] is False
    wait_until(lambda: [d["reason"] for d in rig.loop.decisions(MODEL, last=1)] == ["disabled"], 60,
               "a tick after switching adaptation off to log 'disabled'")
    r = requests.put(f"{api}/v1/models/{MODEL}/adapt", json={"enabled": True}, headers=mgmt, timeout=10)
    assert r.json()["enabled"] is True
    assert requests.put(f"{api}/v1/models/{MODEL}/adapt", json={"enabled": False},
                        timeout=10).status_code == 401
    assert requests.get(f"{api}/v1/models/{MODEL}/adapt", timeout=10).status_code == 401
    assert requests.get(f"{api}/v1/models/{MODEL}/adapt", headers=mgmt, timeout=10).json()["enabled"] is True


def test_steps_converge_with_one_swap_each(tmp_path: Path, shared_torchserve: RunningServer) -> None:
    profile = table_profile("sleepy", sleep_table(SLEEP_MODEL))
    expected = {b: realizable_plan(profile, 2, b) for b in LEVELS}
    # the table makes the three plans differ, so each step needs a swap
    assert not same_shape(expected[1], expected[2]) and not same_shape(expected[2], expected[8])

    # attached to the TorchServe the bench modules share (bench_support): nothing here is
    # about the server's own start
    rig = Rig(store=tmp_path / "store", workdir=tmp_path, model=MODEL, base_dir=SLEEP_MODEL,
              profile=profile, settings=SETTINGS, rest=True, server=shared_torchserve)
    changes: list[tuple[float, int]] = []  # (time, clients), the last is the stop (0)
    with rig:
        rig.apply(expected[LEVELS[0]])  # start on the plan for one client
        rig.start_loop()
        server = rig.server
        api, mgmt = rig.api_url, server.keys.management_headers()
        _switch_off_and_on(rig, api, mgmt)

        # One step that outlasts the test: the test moves the level itself, each time the
        # loop has settled on the previous one.
        load = StepLoad(f"{server.inference_url}/predictions/{MODEL}", [Step(max(LEVELS), 24 * 3600.0)],
                        headers=server.inference_headers, clock=time.time).start()
        try:
            for level in LEVELS:
                changes.append((time.time(), level))
                load.level = level
                wait_until(lambda: _settled(_decisions(rig), changes[-1][0], level), SETTLE_S,
                           f"the loop to settle on the plan for B={level}")
        finally:
            load.stop()
            changes.append((time.time(), 0))
            records = load.join(timeout_s=120)
        status = requests.get(f"{api}/v1/models/{MODEL}/status", headers=mgmt, timeout=30).json()
        # off before counting, so no swap lands between reading the log and the metric
        requests.put(f"{api}/v1/models/{MODEL}/adapt", json={"enabled": False}, headers=mgmt, timeout=10)
        wait_until(lambda: _decisions(rig)[-1]["reason"] == "disabled", 60,
                   "a tick after switching adaptation off to log 'disabled'")
        decisions = _decisions(rig)
        metrics = requests.get(f"{api}/metrics", timeout=10).text
    # the rig removed its model and every version, and left the server serving
    assert no_models_left(shared_torchserve) == [] and shared_torchserve.is_running()
    assert archives_left(shared_torchserve) == []

    # kept for post-mortems (pytest keeps the last few tmp dirs), and the
    # decision changes printed (shown with -s or on failure)
    (tmp_path / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions))
    start, prev = changes[0][0], None
    for d in decisions:
        key = (d["estimated_batch"], d["reason"], d["active_batch"])
        if key != prev:
            print(f"{d['time_s'] - start:7.1f}s B={key[0]} {key[1]:<22} active={key[2]} "
                  f"gain={d['corrected_gain']} gap={d['latency_gap']} "
                  f"conc={d['estimate']['concurrency']}")
        prev = key

    # 1. no request failed across the run (swaps included), and every level was sent
    bad = [r for r in records if not r.ok]
    assert not bad, bad[:5]
    assert {r.level for r in records} >= set(LEVELS)

    # 2. per step: the swap to the plan for the level (none needed for the first, which
    # starts on its plan), no flapping: a second swap only when B was read mid-change on
    # a busy machine (min dwell keeps swaps 20 s apart)
    report = []
    for (t0, level), (t1, _) in zip(changes, changes[1:]):
        swaps = [d for d in decisions if t0 < d["time_s"] <= t1 and d["swap"]]
        assert len(swaps) <= 2, [(d["time_s"] - t0, d["estimated_batch"]) for d in swaps]
        report.append((level, len(swaps), swaps[-1]["target"]["instances"] if swaps else None))
        if level != LEVELS[0]:
            assert swaps, f"B={level}: settled without a swap"
        if swaps:
            # the plan for this level: the optimiser's, unless the measured gap
            # (contention correction) made another plan for the same B better
            target = swaps[-1]["target"]
            assert target["batch"] == level
            assert Plan.from_dict(swaps[-1]["optimiser_choice"]).shape == expected[level].shape
            assert (Plan.from_dict(target).shape == expected[level].shape
                    or swaps[-1]["correction_changed_choice"])
    print("adaptation per step (level, swaps, plan):", report)

    # 3. the decisions are visible in status and counted in /metrics (the count the log shows)
    assert status["adapt"]["enabled"] is True and status["adapt"]["last_decision"]["model"] == MODEL
    swapped = sum(1 for d in decisions if d["swap"])
    assert swapped >= len(LEVELS) - 1
    assert f'packrat_adapt_swaps_total{{model="{MODEL}"}} {float(swapped)}' in metrics
    assert "packrat_batch_estimates_total" in metrics
    json.dumps(status)  # plain JSON all the way
