"""Live swaps against a real TorchServe (token auth on) under continuous checked load.

One TorchServe for the module, serving `swap-bert` (the tiny-bert archive
under another name in a private model store, so version dirs this module
creates and deletes touch no other test's store).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from packrat.apply import versions
from packrat.apply.loadcheck import ContinuousLoad
from packrat.apply.server import start_torchserve
from packrat.apply.swap import SwapSettings, Swapper, check_workers, proc_affinity
from packrat.errors import SwapError
from packrat.types import Instance, Plan

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]

MODEL = "swap-bert"
TEXTS = [f"review number {i}: {'good ' * (i % 5)}{'bad ' * (i % 3)}".encode() for i in range(16)]
# 1 x (2 threads) and 2 x (1 thread), as the issue asks; batch caps differ per version.
FAT = Plan(cores=2, batch=4, instances=(Instance(2, 4, 0.0),), predicted_latency_ms=0.0)
THIN = Plan(cores=2, batch=4, instances=(Instance(1, 2, 0.0), Instance(1, 2, 0.0)), predicted_latency_ms=0.0)


@pytest.fixture(scope="module")
def served(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("swap-store")
    (store / MODEL).symlink_to(tiny_store / "tiny-bert", target_is_directory=True)
    server = start_torchserve(store, tmp_path_factory.mktemp("swap-ts"))
    try:
        client = server.management_client()
        client.register(MODEL, MODEL, 1)
        yield server, client, store
    finally:
        server.stop()


def reference_answers(server) -> list[dict]:
    import requests

    out = []
    for text in TEXTS:
        r = requests.post(f"{server.inference_url}/predictions/{MODEL}", data=text,
                          headers=server.inference_headers(), timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


def make_check(refs: list[dict]):
    def check(i: int, body: bytes) -> bool:
        got = json.loads(body)
        want = refs[i]
        # Same weights in every version; 1 vs 2 threads may change the last float bits only.
        return got["label"] == want["label"] and all(
            abs(got["scores"][k] - v) < 1e-4 for k, v in want["scores"].items()
        )

    return check


def assert_as_planned(client, store: Path) -> list:
    d = client.describe(MODEL)
    vdir = versions.load_version(store / d["modelUrl"])
    assert vdir is not None, f"default version {d['modelVersion']} is not a Packrat version"
    checks = check_workers(d, vdir)
    assert len(checks) == len(vdir.slots), checks
    for c in checks:
        assert c.ok, c.why
        # Read back independently of the checker: the kernel's view and the worker's own report.
        assert proc_affinity(c.pid) == c.cores
        assert c.torch_threads == vdir.slots[c.slot].threads
    assert sorted(c.slot for c in checks) == list(range(len(vdir.slots)))
    return checks


def test_ten_swaps_under_load_fail_no_request(served) -> None:
    server, client, store = served
    refs = reference_answers(server)
    swapper = Swapper(client, store, cores=[0, 1])
    load = ContinuousLoad(
        url=f"{server.inference_url}/predictions/{MODEL}",
        headers=server.inference_headers(),
        bodies=TEXTS,
        check=make_check(refs),
        clients=8,
    )
    records = []
    with load:
        time.sleep(1.0)
        for k in range(10):
            plan = THIN if k % 2 == 0 else FAT
            before = len(load.snapshot())
            rec = swapper.apply(MODEL, plan)
            records.append(rec)
            assert rec.outcome == "applied", rec
            assert client.describe(MODEL)["modelVersion"] == rec.to_version
            # Only the new version is loaded: the old one was drained and unregistered.
            assert [d["modelVersion"] for d in client.describe_all(MODEL)] == [rec.to_version]
            checks = assert_as_planned(client, store)
            assert len(checks) == len(plan.instances)
            assert len(load.snapshot()) > before, "load stalled during a swap"
            assert not load.failures(), load.failures()[:3]
    samples = load.stop()
    assert len(samples) > 100
    assert not [s for s in samples if not s.ok]
    # Retired version dirs are gone; only the live one and the base remain.
    assert sorted(p.name for p in store.iterdir()) == sorted([MODEL, f"{MODEL}.{records[-1].to_version}"])


def test_killed_worker_reclaims_its_slot(served) -> None:
    server, client, store = served
    refs = reference_answers(server)
    swapper = Swapper(client, store, cores=[0, 1])
    if len(client.describe(MODEL)["workers"]) != 2:
        swapper.apply(MODEL, THIN)
    before = {c.slot: c for c in assert_as_planned(client, store)}
    victim = before[1]
    load = ContinuousLoad(
        url=f"{server.inference_url}/predictions/{MODEL}",
        headers=server.inference_headers(),
        bodies=TEXTS,
        check=make_check(refs),
        clients=8,
    )
    with load:
        time.sleep(1.0)
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            d = client.describe(MODEL)
            pids = {w["pid"] for w in d["workers"] if w["status"] == "READY"}
            if len(pids) == 2 and victim.pid not in pids and all(c.ok for c in check_workers(
                    d, versions.load_version(store / d["modelUrl"]))):
                break
            time.sleep(0.3)
        time.sleep(1.0)
    after = {c.slot: c for c in assert_as_planned(client, store)}
    assert after[0].pid == before[0].pid  # the survivor was not touched
    assert after[1].pid != victim.pid  # TorchServe restarted the killed worker...
    assert after[1].cores == victim.cores  # ...and it took the freed slot, on the same cores
    failed = [s for s in load.samples if not s.ok]
    print(f"kill -9 under load: {len(failed)} failed of {len(load.samples)}")
    # Only what was in flight on the killed worker may fail: at most one batch (cap 2).
    assert len(failed) <= 2, failed


def test_failed_swap_rolls_back_and_old_version_keeps_serving(served) -> None:
    server, client, store = served
    refs = reference_answers(server)
    old = client.describe(MODEL)["modelVersion"]
    # Core 4095 does not exist: the second worker cannot pin itself and never gets READY.
    swapper = Swapper(client, store, cores=[0, 4095],
                      settings=SwapSettings(register_timeout_s=60, ready_timeout_s=30))
    load = ContinuousLoad(
        url=f"{server.inference_url}/predictions/{MODEL}",
        headers=server.inference_headers(),
        bodies=TEXTS,
        check=make_check(refs),
        clients=8,
    )
    with load:
        with pytest.raises(SwapError) as info:
            swapper.apply(MODEL, THIN)
    record = info.value.record
    assert record.outcome == "rolled_back", record
    assert client.describe(MODEL)["modelVersion"] == old
    assert [d["modelVersion"] for d in client.describe_all(MODEL)] == [old]
    assert not (store / f"{MODEL}.{record.to_version}").exists()
    assert not [s for s in load.samples if not s.ok]
    assert len(load.samples) > 20


def test_heterogeneous_threads_in_one_version(served) -> None:
    """2 threads + 1 thread in one version. Two cores only, so the 1-thread slot
    shares core 1 with the 2-thread one (the layout is what is under test)."""
    server, client, store = served
    plan = Plan(cores=3, batch=4, instances=(Instance(2, 2, 0.0), Instance(1, 2, 0.0)), predicted_latency_ms=0.0)
    swapper = Swapper(client, store, cores=[0, 1, 1])
    rec = swapper.apply(MODEL, plan)
    assert rec.outcome == "applied"
    checks = assert_as_planned(client, store)
    by_slot = {c.slot: c for c in checks}
    assert by_slot[0].cores == (0, 1) and by_slot[0].torch_threads == 2
    assert by_slot[1].cores == (1,) and by_slot[1].torch_threads == 1
    assert client.describe(MODEL)["batchSize"] == 2
