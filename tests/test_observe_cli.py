"""`packrat controller` runs the re-plan loop by default: a real controller
subprocess against a real TorchServe (token auth on) takes a plain model
version to its plan once load arrives, logs every decision as a JSON line,
shows the loop in status and exports its counters at /metrics."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from packrat.server import free_ports, start_torchserve
from packrat.bench.adapt_rig import sleep_table, table_profile
from packrat.bench.loadgen import Step, StepLoad
from packrat.plan import realizable_plan
from packrat.profile.store import save_profile
from serving_support import cpu_list, usable_cores
from waiting import wait_until

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]

SLEEP_MODEL = Path(__file__).parent / "data" / "observe" / "sleepmodel"
MODEL = "sleepy"


def _shape(plan: dict) -> list[tuple[int, int]]:
    return sorted((i["threads"], i["batch"]) for i in plan["instances"])


def _last_reason(api: str, mgmt: dict) -> str | None:
    last = requests.get(f"{api}/v1/models/{MODEL}/adapt?last=1", headers=mgmt, timeout=10).json()
    return last["decisions"][-1]["reason"] if last["decisions"] else None


def _logged_reasons(state: Path) -> list[str]:
    log = state / "decisions.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(x)["reason"] for x in lines if x.endswith("}")]  # a line being written: not yet


def test_controller_adapts_by_default(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    shutil.copytree(SLEEP_MODEL, store / MODEL)
    state = tmp_path / "state"
    profile = table_profile(MODEL, sleep_table(SLEEP_MODEL))
    save_profile(profile, state / "profiles" / f"{MODEL}.json")
    server = start_torchserve(store, tmp_path / "ts")
    proc = None
    try:
        server.management_client().register(MODEL, MODEL, 1)  # a plain version, no plan
        port = free_ports(1)[0]
        api = f"http://127.0.0.1:{port}"
        out = open(tmp_path / "controller.out", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "packrat.cli", "controller",
             "--management-url", server.management_url, "--metrics-url", server.metrics_url,
             "--key-file", str(server.key_file), "--model-store", str(store),
             "--state-dir", str(state), "--cores", cpu_list(usable_cores(2)), "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        mgmt = server.management_headers()

        def controller_up() -> bool:
            assert proc.poll() is None, (tmp_path / "controller.out").read_text()
            try:
                return requests.get(f"{api}/metrics", timeout=10).status_code == 200
            except (requests.ConnectionError, requests.Timeout):
                return False
        wait_until(controller_up, 180, "the controller's API to answer")

        # two clients until the loop has put the plan for B=2 in place
        load = StepLoad(f"{server.inference_url}/predictions/{MODEL}", [Step(2, 24 * 3600.0)],
                        headers=server.inference_headers, clock=time.time).start()
        want = realizable_plan(profile, 2, 2)

        def plan_for_two() -> dict | None:
            # The first plan may be for what B read while the load was starting (1, on a busy
            # machine whose worker answered late): the loop then moves on to B=2's.
            plan = requests.get(f"{api}/v1/models/{MODEL}/status", headers=mgmt, timeout=30).json()["plan"]
            return plan if plan is not None and _shape(plan) == _shape(want.to_dict()) else None
        plan = wait_until(plan_for_two, 300,
                          f"the loop to put the plan for B=2 in place (log: {tmp_path / 'controller.out'})")
        # switch the loop off over REST; decisions say so from the next tick
        r = requests.put(f"{api}/v1/models/{MODEL}/adapt", json={"enabled": False}, headers=mgmt, timeout=10)
        assert r.status_code == 200 and r.json()["enabled"] is False
        # the next tick says so (the tick that swapped may still be finishing the swap),
        # over REST and in the decision log
        wait_until(lambda: _last_reason(api, mgmt) == "disabled", 120, "a tick after switching adaptation off")
        wait_until(lambda: _logged_reasons(state)[-1:] == ["disabled"], 60, "the decision log's 'disabled' line")
        load.stop()
        records = load.join(timeout_s=60)
        status = requests.get(f"{api}/v1/models/{MODEL}/status", headers=mgmt, timeout=30).json()
        adapt = requests.get(f"{api}/v1/models/{MODEL}/adapt?last=5", headers=mgmt, timeout=10).json()
        metrics = requests.get(f"{api}/metrics", timeout=10).text
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        server.stop()

    # the plain version was replaced by the plan for two clients, without a failed request
    assert records and all(r.ok for r in records)
    # every tick left one JSON line in the state dir's decision log
    lines = [json.loads(x) for x in (state / "decisions.jsonl").read_text().splitlines()]
    assert len(lines) >= 5 and all(x["model"] == MODEL for x in lines)
    swaps = [x for x in lines if x["swap"]]
    # the first swap replaced the plain version; the last put B=2's plan in place (the only
    # swap where B read 2 from the start; more where B read what a starting load gave)
    assert swaps and swaps[0]["reason"] == "no-active-plan", [x["reason"] for x in swaps]
    assert _shape(swaps[-1]["target"]) == _shape(plan)
    assert lines[-1]["reason"] == "disabled"
    # status, the adapt endpoint and /metrics show the same loop
    assert status["adapt"]["enabled"] is False
    assert status["adapt"]["last_swap_decision"]["reason"] == swaps[-1]["reason"]
    assert adapt["enabled"] is False and adapt["decisions"][-1]["reason"] == "disabled"
    assert f'packrat_adapt_swaps_total{{model="{MODEL}"}} {float(len(swaps))}' in metrics
    assert f'packrat_adapt_enabled{{model="{MODEL}"}} 0.0' in metrics
    # the persisted policy state keeps the switch for a restarted controller
    saved = json.loads((state / "policy-state.json").read_text())
    assert saved[MODEL]["enabled"] is False
