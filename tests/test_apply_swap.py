"""Live swaps against a real TorchServe (token auth on) under continuous checked load.

One TorchServe for the module, serving `swap-echo` (the noop archive: answers
with the request body; its handler claims and pins slots like every Packrat
handler) under its own name in a private model store, so version dirs this
module creates and deletes touch no other test's store.

Why the echo model: what is tested is the swap (drain, pinning, slot claims,
torch thread counts), and a worker that imports transformers and loads a
model on one core shared with 8 busy clients takes ~20-70 s to start here,
which would make ten swaps take 8 minutes. scripts/measure_swap.py measures
swaps of a real model (all-MiniLM-L6-v2).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from packrat.apply import versions
from packrat.bench.loadcheck import ContinuousLoad
from packrat.server import start_torchserve
from packrat.apply.swap import SwapSettings, Swapper, check_workers, proc_affinity
from packrat.errors import SwapError
from packrat.types import Instance, Plan

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]

ECHO = "swap-echo"
# 1 x (2 threads) and 2 x (1 thread), as the issue asks; batch caps differ per version.
FAT = Plan(cores=2, batch=4, instances=(Instance(2, 4, 0.0),), predicted_latency_ms=0.0)
THIN = Plan(cores=2, batch=4, instances=(Instance(1, 2, 0.0), Instance(1, 2, 0.0)), predicted_latency_ms=0.0)


@pytest.fixture(scope="module")
def served(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("swap-store")
    (store / ECHO).symlink_to(tiny_store / "noop", target_is_directory=True)
    server = start_torchserve(store, tmp_path_factory.mktemp("swap-ts"))
    try:
        client = server.management_client()
        client.register(ECHO, ECHO, 1)
        yield server, client, store
    finally:
        server.stop()


def assert_as_planned(client, store: Path, model: str = ECHO) -> list:
    d = client.describe(model)
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
    swapper = Swapper(client, store, cores=[0, 1])
    bodies = [f"request {i} payload".encode() * (1 + i % 4) for i in range(32)]
    load = ContinuousLoad(
        url=f"{server.inference_url}/predictions/{ECHO}",
        headers=server.inference_headers(),
        bodies=bodies,
        check=lambda i, body: body == bodies[i],  # the echo must be this request's own body
        clients=8,
    )
    records = []
    with load:
        time.sleep(1.0)
        for k in range(10):
            plan = THIN if k % 2 == 0 else FAT
            before = len(load.snapshot())
            t_swap = time.monotonic()
            rec = swapper.apply(ECHO, plan)
            records.append(rec)
            print(f"swap {k} at {t_swap:.1f}: {rec.from_version}->{rec.to_version} {rec.duration_s}s {rec.phases_s}")
            assert rec.outcome == "applied", rec
            assert client.describe(ECHO)["modelVersion"] == rec.to_version
            # Only the new version is loaded: the old one was drained and unregistered.
            assert [d["modelVersion"] for d in client.describe_all(ECHO)] == [rec.to_version]
            checks = assert_as_planned(client, store, ECHO)
            assert len(checks) == len(plan.instances)
            assert len(load.snapshot()) > before, "load stalled during a swap"
            assert not load.failures(), load.failures()[:3]
    samples = load.stop()
    print(f"{len(samples)} requests during 10 swaps, {sum(not s.ok for s in samples)} failed")
    assert len(samples) > 100
    assert not [s for s in samples if not s.ok]
    # Retired version dirs are gone; only the live one and the bases remain.
    assert sorted(p.name for p in store.iterdir() if p.name.startswith(ECHO)) == sorted(
        [ECHO, f"{ECHO}.{records[-1].to_version}"]
    )


def echo_load(server, clients: int = 8) -> ContinuousLoad:
    bodies = [f"echo {i}".encode() * (1 + i % 3) for i in range(16)]
    return ContinuousLoad(
        url=f"{server.inference_url}/predictions/{ECHO}",
        headers=server.inference_headers(),
        bodies=bodies,
        check=lambda i, body: body == bodies[i],
        clients=clients,
    )


def test_killed_worker_reclaims_its_slot(served) -> None:
    server, client, store = served
    swapper = Swapper(client, store, cores=[0, 1])
    if len(client.describe(ECHO)["workers"]) != 2:
        swapper.apply(ECHO, THIN)
    before = {c.slot: c for c in assert_as_planned(client, store, ECHO)}
    victim = before[1]
    load = echo_load(server)
    with load:
        time.sleep(1.0)
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            d = client.describe(ECHO)
            pids = {w["pid"] for w in d["workers"] if w["status"] == "READY"}
            if len(pids) == 2 and victim.pid not in pids and all(c.ok for c in check_workers(
                    d, versions.load_version(store / d["modelUrl"]))):
                break
            time.sleep(0.3)
        time.sleep(1.0)
    after = {c.slot: c for c in assert_as_planned(client, store, ECHO)}
    assert after[0].pid == before[0].pid  # the survivor was not touched
    assert after[1].pid != victim.pid  # TorchServe restarted the killed worker...
    assert after[1].cores == victim.cores  # ...and it took the freed slot, on the same cores
    failed = [s for s in load.samples if not s.ok]
    print(f"kill -9 under load: {len(failed)} failed of {len(load.samples)}: {[s.error for s in failed]}")
    # Only what was in flight on the killed worker may fail: at most one batch (cap 2).
    assert len(failed) <= 2, failed


def test_failed_swap_rolls_back_and_old_version_keeps_serving(served) -> None:
    server, client, store = served
    old = client.describe(ECHO)["modelVersion"]
    # Core 4095 does not exist: the second worker cannot pin itself and never gets READY.
    swapper = Swapper(client, store, cores=[0, 4095],
                      settings=SwapSettings(register_timeout_s=60, ready_timeout_s=30))
    load = echo_load(server)
    with load:
        time.sleep(0.5)
        with pytest.raises(SwapError) as info:
            swapper.apply(ECHO, THIN)
        time.sleep(0.5)
    record = info.value.record
    print(f"rolled back after {record.duration_s}s: {record.error}")
    assert record.outcome == "rolled_back", record
    assert client.describe(ECHO)["modelVersion"] == old
    assert [d["modelVersion"] for d in client.describe_all(ECHO)] == [old]
    assert not (store / f"{ECHO}.{record.to_version}").exists()
    assert not [s for s in load.samples if not s.ok]
    assert len(load.samples) > 20


def test_heterogeneous_threads_in_one_version(served) -> None:
    """2 threads + 1 thread in one version. Two cores only, so the 1-thread slot
    shares core 1 with the 2-thread one (the layout is what is under test)."""
    server, client, store = served
    plan = Plan(cores=3, batch=4, instances=(Instance(2, 2, 0.0), Instance(1, 2, 0.0)), predicted_latency_ms=0.0)
    swapper = Swapper(client, store, cores=[0, 1, 1])
    rec = swapper.apply(ECHO, plan)
    assert rec.outcome == "applied"
    checks = assert_as_planned(client, store, ECHO)
    by_slot = {c.slot: c for c in checks}
    assert by_slot[0].cores == (0, 1) and by_slot[0].torch_threads == 2
    assert by_slot[1].cores == (1,) and by_slot[1].torch_threads == 1
    assert client.describe(ECHO)["batchSize"] == 2
