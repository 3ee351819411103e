"""The controller as users run it: `packrat controller` attached to a real TorchServe.

The controller runs as a subprocess (so it can be killed with SIGKILL); every
REST call carries TorchServe's management token. The model is the noop
archive (fast worker start); the profile endpoint runs the real profiler on it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from packrat.bench.loadgen import ContinuousLoad
from packrat.control import Controller, ControllerSettings
from packrat.plan import realizable_plan
from packrat.profile.store import save_profile
from packrat.types import Profile, ProfilePoint
from serving_support import ControllerProcess, start_server, stop_in_background, usable_cores
from test_reliability_faults import in_process
from waiting import wait_until

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]

MODEL = "ctl-echo"


@pytest.fixture(scope="module")
def stack(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("ctl-store")
    (store / MODEL).symlink_to(tiny_store / "noop", target_is_directory=True)
    server = start_server(store, tmp_path_factory.mktemp("ctl-ts"))
    state = tmp_path_factory.mktemp("ctl-state")
    ctl = Ctl(server, store, state)
    try:
        server.management_client().register(MODEL, MODEL, 1)
        ctl.start()
        yield server, ctl, store
    finally:
        ctl.kill()
        stop_in_background(server)


class Ctl(ControllerProcess):
    """One `packrat controller` subprocess; restartable."""

    def __init__(self, server, store: Path, state: Path) -> None:
        # The re-plan loop (issue 5) has its own tests; here every swap is one the test asked for.
        # Tuning (issue 12, tests/test_tune.py) would swap on its own.
        super().__init__(server, store, state, ["--no-adapt", "--no-tune"], ready_path="/v1/models")

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(f"{self.url}{path}", headers=kw.pop("headers", self.headers()), timeout=120, **kw)

    def post(self, path: str, body: dict, **kw) -> requests.Response:
        return requests.post(
            f"{self.url}{path}", json=body, headers=kw.pop("headers", self.headers()), timeout=300, **kw
        )


ENDPOINTS = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}/status", None),
    ("POST", f"/v1/models/{MODEL}/plan", {"batch": 2}),
    ("POST", f"/v1/models/{MODEL}/apply", {"instances": [{"threads": 1, "batch": 1}]}),
    ("PUT", f"/v1/models/{MODEL}/pin", {"pinned": False}),
    ("POST", f"/v1/models/{MODEL}/profile", {"max_batch": 1}),
    ("GET", "/v1/jobs/none", None),
    ("GET", "/v1/jobs", None),
    ("GET", "/v1/swaps", None),
    ("GET", "/v1/cores", None),
    ("GET", f"/v1/models/{MODEL}/adapt", None),
    ("PUT", f"/v1/models/{MODEL}/adapt", {"enabled": False}),
    ("POST", f"/v1/models/{MODEL}/tune", {"modes": ["fp32-eager"]}),
    ("GET", f"/v1/models/{MODEL}/tune", None),
]
# Open on purpose (docs/live-plans.md): the Prometheus scrape endpoint and the liveness probe's.
OPEN = {("GET", "/metrics"), ("GET", "/healthz")}


def test_endpoint_list_covers_every_route() -> None:
    """Every route of the API is in ENDPOINTS (or deliberately open), so a route
    added later without its 401 check here fails this test."""
    spec = json.loads((Path(__file__).resolve().parents[1] / "docs" / "openapi.json").read_text())
    routes = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    listed = {(m, p.replace(MODEL, "{model}").replace("/none", "/{job_id}")) for m, p, _ in ENDPOINTS}
    assert routes - OPEN == listed


def test_every_endpoint_refuses_without_the_management_token(stack) -> None:
    server, ctl, _ = stack
    swaps_before = len(ctl.get("/v1/swaps").json())
    wrong = [{}, {"Authorization": "Bearer nope"}, server.inference_headers(),
             {"Authorization": server.management_headers()["Authorization"].replace("Bearer", "Basic")}]
    for method, path, body in ENDPOINTS:
        for headers in wrong:
            r = requests.request(method, f"{ctl.url}{path}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
    # Nothing was applied by any of those calls.
    assert len(ctl.get("/v1/swaps").json()) == swaps_before


def _write_profile(ctl: Ctl, sizes: list[list] | None = None) -> Profile:
    # L(t, b): a 2-thread instance is 1.6x faster than a 1-thread one; latency grows with b.
    points = tuple(
        ProfilePoint(threads=t, batch=b, mean_ms=round(10.0 * b ** 0.8 / (1.6 if t == 2 else 1.0), 3))
        for t in (1, 2) for b in (1, 2, 4)
    )
    # `sizes`: as if timed at these request sizes (the profiler's settings record them).
    prof = Profile(model_id="test", points=points, extra={"settings": {"sizes": sizes}} if sizes else {})
    # A per-mode profile (what a profile job writes) would be preferred to this one.
    shutil.rmtree(ctl.state / "profiles" / MODEL, ignore_errors=True)
    save_profile(prof, ctl.state / "profiles" / f"{MODEL}.json")
    return prof


def _applied_swaps(ctl) -> float:
    """packrat_swaps_total{model=MODEL, outcome="applied"} from the controller's /metrics (0 before any)."""
    want = f'packrat_swaps_total{{model="{MODEL}",outcome="applied"}} '
    lines = [x for x in requests.get(f"{ctl.url}/metrics", timeout=30).text.splitlines() if x.startswith(want)]
    return float(lines[0][len(want):]) if lines else 0.0


def test_plan_apply_status_and_malformed_plans(stack) -> None:
    server, ctl, store = stack
    prof = _write_profile(ctl, sizes=[["tokens", 5]])
    # Compute without applying: the optimiser's realisable plan, version unchanged.
    version0 = ctl.get(f"/v1/models/{MODEL}/status").json()["version"]
    r = ctl.post(f"/v1/models/{MODEL}/plan", {"batch": 4})
    assert r.status_code == 200, r.text
    want = realizable_plan(prof, 2, 4)
    assert [(i["threads"], i["batch"]) for i in r.json()["instances"]] == [
        (i.threads, i.batch) for i in want.instances]
    assert r.json()["predicted_latency_ms"] == pytest.approx(want.predicted_latency_ms)
    assert ctl.get(f"/v1/models/{MODEL}/status").json()["version"] == version0

    # Apply an explicit plan: 2 x (1 thread, batch 2), counted in /metrics by the controller.
    applied0 = _applied_swaps(ctl)
    r = ctl.post(f"/v1/models/{MODEL}/apply", {"instances": [{"threads": 1, "batch": 2}] * 2})
    assert r.status_code == 200, r.text
    swap = r.json()["swap"]
    assert swap["outcome"] == "applied" and swap["from_version"] == version0
    assert _applied_swaps(ctl) == applied0 + 1
    st = ctl.get(f"/v1/models/{MODEL}/status").json()
    assert st["version"] == swap["to_version"]
    # Where the workers pin and the cores the model may use (no re-plan loop: no division,
    # every usable core), as GET /v1/cores reports them.
    cores = ctl.get("/v1/cores").json()
    assert cores["usable"] and cores["reason"] and cores["division"] is None
    assert st["share"] == cores["usable"] and set(st["cores"]) <= set(cores["usable"])
    assert len(st["cores"]) == 2  # two 1-thread workers, each on its own core
    assert [(i["threads"], i["batch"]) for i in st["plan"]["instances"]] == [(1, 2), (1, 2)]
    # Predicted latency comes from the profile: L(1, 2) = 10 * 2^0.8.
    assert st["predicted_latency_ms"] == pytest.approx(10.0 * 2 ** 0.8, rel=1e-3)
    assert sorted(tuple(w["affinity"]) for w in st["workers"]) == [(c,) for c in usable_cores(2)]
    assert all(w["as_planned"] and w["torch_threads"] == 1 for w in st["workers"])
    assert st["last_swaps"][-1]["to_version"] == swap["to_version"]
    assert st["last_swaps"][-1]["duration_s"] > 0

    # Apply a computed plan for batch 4 (the profile's realisable plan).
    r = ctl.post(f"/v1/models/{MODEL}/apply", {"batch": 4})
    assert r.status_code == 200, r.text
    st = ctl.get(f"/v1/models/{MODEL}/status").json()
    assert [(i["threads"], i["batch"]) for i in st["plan"]["instances"]] == [
        (i.threads, i.batch) for i in want.instances]
    # The prediction says which input it is for (the profile's timed sizes), in status and
    # /metrics beside packrat_traffic_size.
    assert st["predicted_for"] == {"tokens": 5} and st["plan"]["sizes"] == {"tokens": 5}
    metrics = requests.get(f"{ctl.url}/metrics", timeout=30).text
    assert f'packrat_prediction_size{{kind="tokens",model="{MODEL}"}} 5.0' in metrics

    # Observed latency from TorchServe's metrics once requests were served.
    for _ in range(5):
        requests.post(f"{server.inference_url}/predictions/{MODEL}", data=b"x",
                      headers=server.inference_headers(), timeout=30)
    obs = ctl.get(f"/v1/models/{MODEL}/status").json()["observed"]
    assert obs["requests_total"] >= 5 and obs["mean_latency_ms"] > 0

    # Malformed plans: 4xx with a message, and nothing changes.
    before = ctl.get(f"/v1/models/{MODEL}/status").json()
    swaps_before = len(ctl.get("/v1/swaps").json())
    dirs_before = sorted(p.name for p in store.iterdir())
    bad = [
        (f"/v1/models/{MODEL}/apply", {"instances": [{"threads": 3, "batch": 1}]}, 422),  # > 2 cores
        (f"/v1/models/{MODEL}/apply", {"instances": [{"threads": 1, "batch": 1}] * 3}, 422),  # 3 threads
        (f"/v1/models/{MODEL}/apply", {"instances": [{"threads": 1, "batch": 0}]}, 422),
        (f"/v1/models/{MODEL}/apply", {"instances": [{"threads": 1, "batch": 1}, {"threads": 1, "batch": 2}]}, 422),
        (f"/v1/models/{MODEL}/apply", {"batch": 0}, 422),
        (f"/v1/models/{MODEL}/apply", {}, 422),
        (f"/v1/models/{MODEL}/plan", {"batch": 0}, 422),
        (f"/v1/models/{MODEL}/plan", {"batch": 2, "cores": 3}, 422),
        ("/v1/models/no-such-model/apply", {"instances": [{"threads": 1, "batch": 1}]}, 404),
        ("/v1/models/no-such-model/plan", {"batch": 2}, 404),
    ]
    for path, body, code in bad:
        r = ctl.post(path, body)
        assert r.status_code == code, (path, body, r.status_code, r.text)
        assert r.json().get("detail"), r.text
    assert ctl.get("/v1/models/no-such-model/status").status_code == 404
    after = ctl.get(f"/v1/models/{MODEL}/status").json()
    assert (after["version"], after["plan"]) == (before["version"], before["plan"])
    assert len(ctl.get("/v1/swaps").json()) == swaps_before
    assert sorted(p.name for p in store.iterdir()) == dirs_before


def test_reprofile_job_runs_in_background(stack) -> None:
    _, ctl, _ = stack
    r = ctl.post(f"/v1/models/{MODEL}/profile", {"max_batch": 2, "budget_s": 30, "cores": 1})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["state"] in ("queued", "running")

    def finished() -> dict | None:
        now = ctl.get(f"/v1/jobs/{job['id']}").json()
        return now if now["state"] not in ("queued", "running") else None

    job = wait_until(finished, 600, "the profiling job (a 30 s budget) to finish")
    assert job["state"] == "done", job
    assert job["result"]["points"] >= 1
    # The plan endpoint now uses the fresh profile (1 core profiled -> 1-thread instances).
    r = ctl.post(f"/v1/models/{MODEL}/plan", {"batch": 1, "cores": 1})
    assert r.status_code == 200, r.text
    assert r.json()["instances"][0]["threads"] == 1
    assert ctl.get("/v1/jobs/nope").status_code == 404


def test_controller_killed_under_load_serving_continues(stack) -> None:
    server, ctl, _ = stack
    if ctl.get(f"/v1/models/{MODEL}/status").json()["plan"] is None:  # still the plain version
        r = ctl.post(f"/v1/models/{MODEL}/apply", {"instances": [{"threads": 1, "batch": 2}] * 2})
        assert r.status_code == 200, r.text
    before = ctl.get(f"/v1/models/{MODEL}/status").json()
    assert before["plan"] is not None
    bodies = [f"ctl {i}".encode() for i in range(8)]
    load = ContinuousLoad(
        url=f"{server.inference_url}/predictions/{MODEL}",
        headers=server.inference_headers(),
        bodies=bodies,
        check=lambda i, body: body == bodies[i],
        clients=8,
    )
    with load:
        assert not load.wait_progress(time.monotonic())
        ctl.kill()
        # Still served with no controller: every client is answered.
        assert not load.wait_progress(time.monotonic())
        ctl.start()
        after = ctl.get(f"/v1/models/{MODEL}/status").json()
        assert not load.wait_progress(time.monotonic())
    samples = load.stop()
    assert not [s for s in samples if not s.ok], [s for s in samples if not s.ok][:3]
    assert (after["version"], after["plan"]) == (before["version"], before["plan"])
    assert after["last_swaps"] == before["last_swaps"]


def test_restarted_controller_finishes_a_half_done_swap(stack) -> None:
    """A controller killed mid-swap leaves a loaded non-default version and/or a
    version dir nothing was registered from; the next one cleans both up."""
    from packrat.apply import versions
    from packrat.types import Instance, Plan

    server, ctl, store = stack
    client = server.management_client()
    live = client.describe(MODEL)
    ctl.kill()
    plan = Plan(cores=2, batch=2, instances=(Instance(1, 1, 0.0),) * 2, predicted_latency_ms=0.0)
    live_dir = versions.load_version(store / live["modelUrl"])
    base = live_dir.base if live_dir is not None else live["modelUrl"]  # plain version: itself
    half = versions.create_version(store, base, MODEL, plan, list(usable_cores(2)))
    client.register(half.url, MODEL, 2)  # registered, never made default
    orphan = versions.create_version(store, base, MODEL, plan, list(usable_cores(2)))  # never registered
    assert sorted(d["modelVersion"] for d in client.describe_all(MODEL)) == sorted(
        [live["modelVersion"], half.version])
    ctl.start()
    assert [d["modelVersion"] for d in client.describe_all(MODEL)] == [live["modelVersion"]]
    assert not half.path.exists() and not orphan.path.exists()
    st = ctl.get(f"/v1/models/{MODEL}/status").json()
    assert st["version"] == live["modelVersion"] and st["other_versions"] == []


# -- operator pins (issue 32) ---------------------------------------------------------------
def _put(ctl: Ctl, path: str, body: dict) -> requests.Response:
    return requests.put(f"{ctl.url}{path}", json=body, headers=ctl.headers(), timeout=60)


def _refuse_in_last_tune(ctl: Ctl, store: Path, mode: str, reason: str) -> None:
    """The model's tune record as a tune writes it when `mode`'s worker was refused (its
    accuracy guard failed), for the archive as it is now."""
    from packrat import tune

    tracker = tune.Tracker(ctl.state, MODEL)
    tracker.mode(mode, state="refused", reason=reason, model_id=tune.tune_key(store / MODEL, MODEL)["model_id"])


def test_apply_in_a_mode_pins_the_model_until_unpinned(stack) -> None:
    """An apply with a mode is checked (unknown, not run here, failed its guard: 422 naming
    why), pins the model; the pin survives a restart; under load the loop's ticks say
    "disabled" where they would swap; once unpinned the loop swaps it."""
    server, ctl, store = stack
    _write_profile(ctl)
    status = f"/v1/models/{MODEL}/status"
    assert _put(ctl, f"/v1/models/{MODEL}/pin", {"pinned": False}).json()["pinned"] is False
    own = ctl.get(status).json()["mode"]  # the noop archive's own mode
    assert own
    _refuse_in_last_tune(ctl, store, "int8-eager", "AccuracyGuardError: top-1 agreement 0.61 < 0.99")
    swaps_before = len(ctl.get("/v1/swaps").json())
    one = [{"threads": 1, "batch": 1}]
    bad = [({"batch": 1, "mode": "fp64-eager"}, "unknown mode"),
           ({"batch": 1, "mode": "eager"}, "is not <precision>-<runtime>"),
           ({"instances": one, "mode": "bf16-openvino"}, "the noop task has no model to run in another mode"),
           ({"instances": one, "mode": "int8-eager"}, "failed its accuracy guard for ctl-echo in the last tune: "
                                                      "AccuracyGuardError: top-1 agreement 0.61")]
    try:
        for body, why in bad:
            r = ctl.post(f"/v1/models/{MODEL}/apply", body)
            assert r.status_code == 422 and why in r.json()["detail"], (body, r.status_code, r.text)
        assert len(ctl.get("/v1/swaps").json()) == swaps_before and ctl.get(status).json()["pin"] is None

        r = ctl.post(f"/v1/models/{MODEL}/apply", {"instances": one, "mode": own.upper()})
        assert r.status_code == 200, r.text
        applied = r.json()
        assert applied["plan"]["mode"] == own and applied["pin"]["mode"] == own
        st = ctl.get(status).json()
        assert st["pin"] == applied["pin"] and st["version"] == applied["swap"]["to_version"]
        assert st["plan"]["instances"] == applied["plan"]["instances"]
        r = ctl.post(f"/v1/models/{MODEL}/tune", {"modes": [own]})
        assert r.status_code == 409 and "pinned" in r.json()["detail"], r.text
    finally:
        (ctl.state / "tune" / f"{MODEL}.json").unlink(missing_ok=True)

    # The same state dir, now with the re-plan loop on (a second's dwell: it would swap at once).
    ctl.kill()
    adaptive = Ctl(server, store, ctl.state)
    adaptive.extra = ["--no-tune", "--min-dwell", "1"]
    bodies = [f"pin {i}".encode() for i in range(4)]
    load = ContinuousLoad(url=f"{server.inference_url}/predictions/{MODEL}", headers=server.inference_headers(),
                          bodies=bodies, check=lambda i, body: body == bodies[i], clients=2)
    try:
        adaptive.start()
        assert adaptive.get(status).json()["pin"] == applied["pin"]  # survived the restart
        with load:
            def held_back() -> list[dict] | None:
                ds = adaptive.get(f"/v1/models/{MODEL}/adapt?last=50").json()["decisions"]
                # Ticks that saw load and a faster plan (1 x (1 thread, cap 1) is the slowest plan
                # on 2 cores: L(2, 1) = 10 / 1.6 ms against 10 ms), and swapped nothing.
                would = [d for d in ds if d["estimate"]["ready"] and not d["estimate"]["idle"]
                         and (d["predicted_gain"] or 0) > 0.1]
                return would if len(would) >= 3 else None

            would = wait_until(held_back, 240, "three loaded ticks of the loop on the pinned model")
            assert {d["reason"] for d in would} == {"disabled"} and not any(d["swap"] for d in would)
            st = adaptive.get(status).json()
            assert st["version"] == applied["swap"]["to_version"] and st["adapt"]["enabled"] is False
            r = _put(adaptive, f"/v1/models/{MODEL}/adapt", {"enabled": True})
            assert r.status_code == 409 and "pinned" in r.json()["detail"], r.text

            r = _put(adaptive, f"/v1/models/{MODEL}/pin", {"pinned": False})
            assert r.status_code == 200 and r.json() == {"model": MODEL, "pinned": False, "pin": None}, r.text
            wait_until(lambda: adaptive.get(status).json()["version"] != applied["swap"]["to_version"], 240,
                       "the loop's swap once the model is unpinned")
        samples = load.stop()
        assert not [s for s in samples if not s.ok], [s for s in samples if not s.ok][:3]
        st = adaptive.get(status).json()
        assert st["pin"] is None and len(st["plan"]["instances"]) * st["plan"]["instances"][0]["threads"] == 2
    finally:
        adaptive.kill()
        ctl.start()


# -- in this process: what the controller asks TorchServe, the swap thread's waiting ---------------
@contextlib.contextmanager
def in_this_process(ctl: Ctl, server, monkeypatch: pytest.MonkeyPatch, **kw) -> Iterator[Controller]:
    """A Controller in this process on the module's state dir (test_reliability_faults.in_process:
    the subprocess one stops meanwhile), reading the workers' status files of this server;
    `kw`: more ControllerSettings."""
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(server.slot_dir))
    settings = ControllerSettings(management_url=server.management_url, key_file=server.key_file,
                                  model_store=ctl.store, state_dir=ctl.state, cores=usable_cores(2), **kw)
    with in_process(ctl, settings) as c:
        yield c


def test_an_apply_for_a_batch_reads_the_model_once(stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """POST /apply {"batch": 2}: the known-model check (list), one reading of the model
    (describe, describe all) passed down to the plan, and the swap's own reading under its
    lock (describe): 3 + 1 management calls before the swap's work, not a second reading."""
    from fastapi.testclient import TestClient

    from packrat.api import create_app
    from packrat.apply.client import ManagementClient
    from packrat.apply.swap import Swapper, SwapSettings

    server, ctl, _ = stack
    _write_profile(ctl)
    calls: list[tuple[str, str]] = []
    real = ManagementClient._request

    def counted(self, method, path, params=None, timeout=None):
        calls.append((method, path))
        return real(self, method, path, params, timeout)

    # No request is sent meanwhile: the swap skips the drain grace after set-default
    # (min_drain_s, 2 s, for requests routed to the old default just before it).
    with in_this_process(ctl, server, monkeypatch, swap=SwapSettings(min_drain_s=0.0)) as c:
        client = TestClient(create_app(c))
        started: list[int] = []
        apply = Swapper.apply

        def swap_begins(self, *a, **kw):  # where the swap's own work (new version, ...) starts
            started.append(len(calls))
            return apply(self, *a, **kw)

        monkeypatch.setattr(ManagementClient, "_request", counted)
        monkeypatch.setattr(Swapper, "apply", swap_begins)
        r = client.post(f"/v1/models/{MODEL}/apply", json={"batch": 2}, headers=server.management_headers())
        assert r.status_code == 200, r.text
    before_swap = calls[:started[0]]
    assert before_swap.count(("GET", "/models")) == 1, before_swap
    assert before_swap.count(("GET", f"/models/{MODEL}/all")) == 1, before_swap
    assert len(before_swap) <= 4, before_swap


def test_a_swap_waiting_for_the_running_one_starts_when_it_ends(stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """Swaps.apply_when_free (a tune's choice while another swap runs): it waits on the
    swap lock's release, trying again once per release, not in a polling loop."""
    from packrat.types import Instance, Plan

    server, ctl, _ = stack
    first = Plan(cores=2, batch=2, instances=(Instance(1, 2, 0.0),) * 2, predicted_latency_ms=0.0)
    second = Plan(cores=2, batch=1, instances=(Instance(2, 1, 0.0),), predicted_latency_ms=0.0)
    with in_this_process(ctl, server, monkeypatch) as c:
        real = c.swaps.lock
        tries: list[float] = []

        class CountingLock:
            def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
                tries.append(time.monotonic())
                return real.acquire(blocking, timeout)

            def release(self) -> None:
                real.release()

        c.swaps.lock = CountingLock()
        running = c.start_swap(MODEL, first)
        result: dict = {}
        waiter = threading.Thread(target=lambda: result.update(record=c.swaps.apply_when_free(MODEL, second, 600)))
        waiter.start()
        running.done.wait(600)
        first_ended = time.monotonic()
        waiter.join(600)
        assert running.error is None and running.record is not None, running.error
        record = result["record"]
        assert record.outcome == "applied" and record.from_version == running.record.to_version
        # The first swap took seconds; the waiter tried once before it ended and once after.
        assert running.record.duration_s > 1.0
        assert len(tries) == 3, tries  # the first swap, the waiter's refused try, its try after the release
        assert tries[-1] >= first_ended - 0.5


def test_describe_answers_of_a_real_torchserve_parse_and_malformed_ones_are_named(stack) -> None:
    from packrat.apply.client import ModelDescription

    server, _, _ = stack
    client = server.management_client()
    one = client.describe(MODEL)
    d = ModelDescription.parse(one)
    assert (d.name, d.version, d.url) == (one["modelName"], one["modelVersion"], one["modelUrl"])
    assert d.batch_size == one["batchSize"] and d.max_batch_delay_ms == one["maxBatchDelay"]
    assert d.worker_pids() == [w["pid"] for w in one["workers"]] and d.worker_pids()
    assert all(w.ready for w in d.workers) and d.pending_requests == one["jobQueueStatus"]["pendingRequests"]
    assert [x.version for x in client.describe_versions(MODEL)] == [x["modelVersion"] for x in client.describe_all(MODEL)]
    malformed = [
        ([one], "a model description is a JSON object, got list"),
        ({k: v for k, v in one.items() if k != "modelUrl"}, "without modelUrl"),
        (dict(one, workers={"pid": 1}), "workers are not a list of objects"),
        (dict(one, workers=[dict(one["workers"][0], pid="twelve")]), "a field is not what TorchServe sends"),
        (dict(one, jobQueueStatus=[1]), "a field is not what TorchServe sends"),
        (dict(one, batchSize="large"), "a field is not what TorchServe sends"),
    ]
    for answer, why in malformed:
        with pytest.raises(ValueError, match=why):
            ModelDescription.parse(answer)


def test_a_malformed_describe_answer_is_torchserves_error() -> None:
    """A describe answer that is not one (from a loopback server in TorchServe's place):
    TorchServeError naming the URL and what is wrong, which the API answers 502."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from packrat.apply.client import ManagementClient
    from packrat.errors import TorchServeError

    answers = {"/models/m": b"[]", "/models/m/all": b'[{"modelName": "m", "modelVersion": "1"}]'}

    class Answers(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = answers[self.path]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        client = ManagementClient(base, None)
        with pytest.raises(TorchServeError, match="malformed describe answer: a describe answer is a non-empty") as a:
            client.describe_model("m")
        assert a.value.url == f"{base}/models/m"
        with pytest.raises(TorchServeError, match="malformed describe answer: a model description without modelUrl"):
            client.describe_versions("m")
    finally:
        httpd.shutdown()
        httpd.server_close()


def _cli(ctl: Ctl, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packrat.cli", *args, "--api", ctl.url,
                           "--key-file", str(ctl.server.key_file)], capture_output=True, text=True, timeout=600)


def test_cli_applies_in_a_mode_pins_and_unpins(stack) -> None:
    """`packrat apply --mode`, `packrat status`, `packrat unpin`, `packrat pin` against the
    controller: each says what the controller's status then shows."""
    _, ctl, _ = stack
    status = f"/v1/models/{MODEL}/status"
    own = ctl.get(status).json()["mode"]
    r = _cli(ctl, "apply", MODEL, "--shape", "2x(t1,b1)", "--mode", own)
    assert r.returncode == 0, r.stderr
    assert f"{MODEL}: pinned to {own} 2x(t1,b1)" in r.stdout
    st = ctl.get(status).json()
    assert st["pin"]["mode"] == own and [(i["threads"], i["batch"]) for i in st["plan"]["instances"]] == [(1, 1)] * 2
    r = _cli(ctl, "status", MODEL)
    assert r.returncode == 0 and "2x(t1,b1)" in r.stdout and " pinned " in r.stdout, r.stdout
    r = _cli(ctl, "unpin", MODEL)
    assert r.returncode == 0 and f"{MODEL}: not pinned" in r.stdout, (r.stdout, r.stderr)
    assert ctl.get(status).json()["pin"] is None
    assert " pinned " not in _cli(ctl, "status", MODEL).stdout
    r = _cli(ctl, "pin", MODEL)
    assert r.returncode == 0 and f"{MODEL}: pinned to {own} 2x(t1,b1)" in r.stdout, (r.stdout, r.stderr)
    assert ctl.get(status).json()["pin"]["mode"] == own
    # Refused: the controller's reason on one line (exit 1); a malformed shape before any call (exit 2).
    r = _cli(ctl, "apply", MODEL, "--batch", "1", "--mode", "fp64-eager")
    assert r.returncode == 1 and "HTTP 422" in r.stderr and "unknown mode" in r.stderr, r.stderr
    r = _cli(ctl, "apply", MODEL, "--shape", "2x(t1,b")
    assert r.returncode == 2 and "is not Nx(tT,bB)" in r.stderr, r.stderr


OWN_HANDLER = '''
def handle(data, context):
    if data is None:
        return None
    return [{"bytes": len(row.get("body") or row.get("data") or b"")} for row in data]
'''


def test_a_model_with_its_own_handler_is_served_but_refused_a_plan_at_once(stack) -> None:
    """A user's own model beside the Packrat ones (`packrat controller` next to their
    TorchServe): an apply waited its whole ready timeout (300 s) for workers that never
    report a pin, holding the swap lock, then failed with 500 "not READY and pinned"."""
    server, ctl, store = stack
    name = "own-handler"
    model = store / name
    (model / "MAR-INF").mkdir(parents=True)
    (model / "handler.py").write_text(OWN_HANDLER)
    (model / "model_config.yaml").write_text("minWorkers: 1\nmaxWorkers: 1\nbatchSize: 1\n")
    (model / "MAR-INF" / "MANIFEST.json").write_text(json.dumps({"runtime": "python", "model": {
        "modelName": name, "handler": "handler.py", "modelVersion": "1.0", "configFile": "model_config.yaml"}}))
    client = server.management_client()
    client.register(name, name, 1)
    try:
        st = ctl.get(f"/v1/models/{name}/status").json()
        assert (st["version"], st["plan"], st["mode"]) == ("1.0", None, None), st
        swaps = len(ctl.get("/v1/swaps").json())
        for path, body in ((f"/v1/models/{name}/apply", {"instances": [{"threads": 1, "batch": 1}], "pin": False}),
                           (f"/v1/models/{name}/apply", {"batch": 1, "pin": False}),
                           (f"/v1/models/{name}/plan", {"batch": 1}),
                           (f"/v1/models/{name}/profile", {"max_batch": 1}),
                           (f"/v1/models/{name}/tune", {})):
            r = ctl.post(path, body)
            assert r.status_code == 422 and "is not a Packrat archive" in r.json()["detail"], (path, r.text)
        assert len(ctl.get("/v1/swaps").json()) == swaps  # refused before anything was attempted
        r = requests.post(f"{server.inference_url}/predictions/{name}", data=b"hello",
                          headers=server.inference_headers(), timeout=60)
        assert r.status_code == 200 and r.json() == {"bytes": 5}, r.text
    finally:
        client.unregister(name, "1.0")
        shutil.rmtree(model)
