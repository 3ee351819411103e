"""Cores divided among models on a real TorchServe (issue 13): two loaded models end up on
disjoint cores, read from their workers' /proc/<pid>/status; when one model's load stops,
the other takes its core, with 0 failed requests on either.

Both models are the sleep model (tests/data/observe/sleepmodel): each batch sleeps a
table latency, and their profiles are that table, so the expected division holds on a
machine busy with other work. On 2 cores at B = 2 each (2 clients per model): one core
each (144 ms) beats sharing; alone, one model's best plan is 2 x (1 thread, cap 1) on
both cores (120 ms against 144 ms on one: a 20 % gain, above the 10 % threshold).
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from packrat import slots
from packrat.bench.adapt_rig import sleep_table, table_profile
from packrat.bench.loadgen import ContinuousLoad
from packrat.control import Controller, ControllerSettings
from packrat.observe.loop import AdaptiveLoop, AdaptSettings
from packrat.observe.policy import PolicySettings
from packrat.plan import realizable_plan
from packrat.profile.store import save_profile
from reliability_support import SLEEP_MODEL, copy_sleep_model, wait_for
from serving_support import start_server, stop_in_background, usable_cores, worker_pids

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]

MODELS = ("alpha", "beta")
IDLE = "gamma"  # never gets a request: moved to one 1-thread worker on the shared (last) core


def worker_cores(server, model: str) -> set[int]:
    """Union of the affinity of `model`'s workers, read from the kernel, not from Packrat."""
    out: set[int] = set()
    for pid in worker_pids(server, model):
        with open(f"/proc/{pid}/status") as f:
            line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
        out |= set(slots.parse_cpu_list(line.split(":", 1)[1].strip()))
    return out


def load(server, model: str) -> ContinuousLoad:
    return ContinuousLoad(url=f"{server.inference_url}/predictions/{model}",
                          headers=server.inference_headers(), bodies=[b"x"],
                          check=lambda i, body: json.loads(body)["batch"] >= 1, clients=2)


def test_two_models_get_disjoint_cores_and_a_load_shift_moves_them(tmp_path: Path,
                                                                   monkeypatch) -> None:
    cores = usable_cores(2)
    store = tmp_path / "store"
    store.mkdir()
    for m in (*MODELS, IDLE):
        copy_sleep_model(store, m)
    server = start_server(store, tmp_path / "ts")
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(server.slot_dir))
    stop = threading.Event()
    loads: dict[str, ContinuousLoad] = {}
    tick = None
    controller = None
    try:
        for m in (*MODELS, IDLE):
            server.management_client().register(m, m, 1)
        settings = ControllerSettings(
            management_url=server.management_url, key_file=server.key_file, model_store=store,
            metrics_url=server.metrics_url, state_dir=tmp_path / "state", cores=cores, tick_s=1.0,
            idle_footprint_after_s=5.0)
        # The correction is off so that other work on this machine cannot change the plans.
        policy = AdaptiveLoop(AdaptSettings(policy=PolicySettings(min_dwell_s=10.0, use_correction=False)))
        controller = Controller(settings, policy=policy)
        controller.acquire()
        profile = table_profile("sleepy", sleep_table(SLEEP_MODEL))
        for m in (*MODELS, IDLE):
            save_profile(profile, controller.profile_path(m))
        # All start as the plan for B=2 on every core: they share both cores. No request is
        # sent yet, so these setup swaps skip the drain grace (SwapSettings.min_drain_s, for
        # requests routed to the old default just before set-default): 3 x 2 s saved. The
        # swaps the loop makes under load below keep it.
        swap_settings = controller.swapper.settings
        controller.swapper.settings = replace(swap_settings, min_drain_s=0.0)
        for m in (*MODELS, IDLE):
            controller.apply(m, realizable_plan(profile, 2, 2))
        controller.swapper.settings = swap_settings
        assert worker_cores(server, "alpha") == worker_cores(server, "beta") == worker_cores(server, IDLE) == set(cores)

        tick = threading.Thread(target=controller.run, args=(stop,), daemon=True)
        tick.start()
        for m in MODELS:
            loads[m] = load(server, m).start()

        def disjoint() -> bool:
            a, b = worker_cores(server, "alpha"), worker_cores(server, "beta")
            return len(a) == 1 and len(b) == 1 and not a & b
        wait_for(disjoint, 300, "two loaded models on disjoint cores")
        division = controller.cores_status()["division"]
        assert division["rule"] == "split"
        assert sorted(len(c) for c in division["shares"].values()) == [1, 1]
        reasons = {d["reason"] for m in MODELS for d in policy.decisions(m, last=50)}
        assert "cores-moved" in reasons
        # The idle model: one 1-thread worker on the shared core, its batch cap kept.
        wait_for(lambda: worker_cores(server, IDLE) == {cores[-1]} and len(worker_pids(server, IDLE)) == 1,
                 300, "the idle model on the shared core")
        assert controller.model_state(IDLE).plan.shape == ((1, 1),)
        # An explicit plan (made for every core) that fits the idle model's share is applied
        # there, labelled with the cores it got; it used to be refused with a ConfigError
        # ("plan is for 2 cores but only 1 are usable", a 422 through the API).
        explicit = controller.explicit_plan(IDLE, [(1, 1)])
        assert explicit.cores == len(cores)
        record = controller.swaps.apply_when_free(IDLE, explicit, timeout_s=120)  # the loop swaps too
        assert record.outcome == "applied" and record.plan.cores == 1, record
        assert worker_cores(server, IDLE) == {cores[-1]}

        # Load shift: beta's clients stop. alpha takes both cores; beta keeps one
        # worker on the shared (last) core.
        beta_samples = loads.pop("beta").stop()
        wait_for(lambda: worker_cores(server, "alpha") == set(cores) and len(worker_pids(server, "alpha")) == 2,
                 300, "alpha on both cores after beta's load stopped")
        assert worker_cores(server, "beta") <= {cores[-1]}
        assert controller.cores_status()["division"]["shares"] == {"alpha": list(cores)}
        alpha_samples = loads.pop("alpha").stop()

        for name, samples in (("alpha", alpha_samples), ("beta", beta_samples)):
            failed = [s for s in samples if not s.ok]
            assert samples and not failed, f"{name}: {len(failed)} of {len(samples)} failed: {failed[:3]}"
        # The swap that gave alpha both cores is recorded once its old version drained: wait
        # for it, so the check below covers every swap (stopping mid-drain records "failed").
        def alpha_on_both_recorded() -> bool:
            lines = (tmp_path / "state" / "swaps.jsonl").read_text().splitlines()
            last = [r for r in map(json.loads, lines) if r["model"] == "alpha"][-1:]
            return bool(last) and len(last[0]["plan"]["instances"]) == 2 and controller.swaps.running is None
        wait_for(alpha_on_both_recorded, 120, "alpha's last swap (onto both cores) recorded")
        swaps = [json.loads(x) for x in (tmp_path / "state" / "swaps.jsonl").read_text().splitlines()]
        assert all(s["outcome"] == "applied" for s in swaps), swaps
    finally:
        for ld in loads.values():
            ld.stop()
        stop.set()
        if tick is not None:
            tick.join(timeout=120)
        if controller is not None:
            controller.release()
        stop_in_background(server)
