"""Faults against a real TorchServe and a real `packrat controller` subprocess.

One TorchServe, two models of the sleep model (tests/data/observe/sleepmodel:
sleeps a table latency per batch and claims its slot like Packrat's handler):

- `victim` takes the faults: its workers are killed with SIGKILL, one and all;
  the controller is SIGKILLed in the middle of each swap phase and restarted;
  TorchServe itself is restarted;
- `bystander` is served by 2 checked clients the whole time: not one of its
  requests may fail while `victim` takes the faults (until TorchServe itself
  is stopped, which stops everything).

After each fault the controller recovers: only the live version of `victim`
stays registered, no version directory is left behind, every worker runs as
planned, and a request that was accepted is answered.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from packrat.api.answers import render_status
from packrat.apply import versions
from packrat.bench.loadgen import ContinuousLoad
from packrat.commands._client import shape_text
from packrat.commands.tune import stage_text
from packrat.control import Controller, ControllerSettings
from packrat.errors import TorchServeError
from packrat.types import Instance, Plan
from reliability_support import copy_sleep_model, holding_unread, wait_for
from serving_support import ControllerProcess, start_server, stop_in_background, usable_cores

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]

VICTIM = "victim"
BYSTANDER = "bystander"
TWO = [{"threads": 1, "batch": 1}] * 2  # 2 workers x (1 thread, cap 1)
ONE = [{"threads": 2, "batch": 1}]  # 1 worker x (2 threads, cap 1)
# What status shows as a running swap's phase, in the order a swap goes through them.
SWAP_PHASES = ("starting", "create", "register", "ready", "set_default", "drain", "retire")
# Per operation and generation mode (valid / invalid inputs): ~20 operations x 2 x this.
FUZZ_EXAMPLES = 10


class Ctl(ControllerProcess):
    """One `packrat controller` subprocess on the module's TorchServe; restartable."""

    def __init__(self, server, store: Path, state: Path) -> None:
        # Every swap here is one the test asked for (or the restart watch's).
        super().__init__(server, store, state, ["--no-adapt", "--no-tune"])

    def apply(self, instances: list[dict], timeout: float = 300) -> requests.Response:
        return requests.post(f"{self.url}/v1/models/{VICTIM}/apply", json={"instances": instances},
                             headers=self.server.management_headers(), timeout=timeout)

    def status(self) -> dict:
        r = self.get(f"/v1/models/{VICTIM}/status")
        assert r.status_code == 200, r.text
        return r.json()


def sleep_load(server, model: str, clients: int = 2) -> ContinuousLoad:
    return ContinuousLoad(url=f"{server.inference_url}/predictions/{model}", headers=server.inference_headers(),
                          bodies=[b"x"], check=lambda i, body: json.loads(body)["batch"] >= 1,
                          clients=clients, timeout_s=90)


def _stack(tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("faults-store")
    for name in (VICTIM, BYSTANDER):
        copy_sleep_model(store, name)
    workdir = tmp_path_factory.mktemp("faults-ts")
    box = {"server": start_server(store, workdir)}
    ctl = None
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PACKRAT_SLOT_DIR", str(box["server"].slot_dir))
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(box["server"].register, (VICTIM, BYSTANDER)))
            ctl = Ctl(box["server"], store, tmp_path_factory.mktemp("faults-state"))
            ctl.start()
            bystander = sleep_load(box["server"], BYSTANDER).start()
            yield box, ctl, store, bystander
            bystander.stop()
    finally:
        if ctl is not None:
            ctl.kill()
        stop_in_background(box["server"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    """Shared by the faults that leave TorchServe running. Each test starts from the
    plan it needs (on_plan), so they pass in any order."""
    yield from _stack(tmp_path_factory)


@pytest.fixture
def own_stack(tmp_path_factory: pytest.TempPathFactory):
    """For the fault that stops TorchServe itself (and with it the bystander)."""
    yield from _stack(tmp_path_factory)


def live_shape(ctl: "Ctl") -> list[dict] | None:
    """TWO or ONE when that is the victim's live Packrat plan, else None (the base model)."""
    plan = ctl.status().get("plan") or {}
    shape = [{"threads": i["threads"], "batch": i["batch"]} for i in plan.get("instances", [])]
    return shape if shape in (TWO, ONE) else None


def on_plan(ctl: "Ctl", store: Path, instances: list[dict]) -> dict:
    """Make `instances` the victim's live plan if it is not (an earlier test may have left
    the other shape), then assert_recovered."""
    st = ctl.status()
    live = [(i["threads"], i["batch"]) for i in (st.get("plan") or {}).get("instances", [])]
    if live != [(i["threads"], i["batch"]) for i in instances]:
        r = ctl.apply(instances)
        assert r.status_code == 200, r.text
    return assert_recovered(ctl, store, instances)


def assert_recovered(ctl: Ctl, store: Path, instances: list[dict], timeout_s: float = 90,
                     gone: set[int] = frozenset()) -> dict:
    """Only the live version of VICTIM is loaded, its workers run as planned (none of the
    `gone` pids among them), no stray version dir."""
    client = ctl.server.management_client()

    def settled() -> bool:
        st = ctl.status()
        return (st["swap_in_progress"] is None and st["other_versions"] == []
                and len(st["workers"]) == len(instances)
                and not gone & {w["pid"] for w in st["workers"]}
                and all(w.get("status") == "READY" and w.get("as_planned") for w in st["workers"]))

    wait_for(settled, timeout_s, "the victim to run as planned again")
    st = ctl.status()
    assert [(i["threads"], i["batch"]) for i in st["plan"]["instances"]] == [
        (i["threads"], i["batch"]) for i in instances]
    assert [d["modelVersion"] for d in client.describe_all(VICTIM)] == [st["version"]]
    assert sorted(p.name for p in store.glob(f"{VICTIM}.p*")) == [st["url"]]
    return st


def last_plan_version(ctl: Ctl) -> str:
    return json.loads((ctl.state / "last-plans.json").read_text())[VICTIM]["version"]


def assert_bystander_untouched(bystander: ContinuousLoad) -> None:
    n = len(bystander.snapshot())
    assert not bystander.failures(), bystander.failures()[:3]
    wait_for(lambda: len(bystander.snapshot()) > n, 30, "the bystander to keep being served")


def test_one_controller_per_torchserve(stack, tmp_path: Path) -> None:
    _, ctl, _, _ = stack
    # Another state dir, same TorchServe (same model store, even through another path).
    link = tmp_path / "store-link"
    link.symlink_to(ctl.store, target_is_directory=True)
    second = Ctl(ctl.server, link, tmp_path / "state2")
    proc = second.spawn()
    assert proc.wait(timeout=60) == 1
    out = (tmp_path / "state2" / "controller.out").read_text()
    assert "another controller manages the TorchServe of this model store" in out, out
    assert f"pid {ctl.proc.pid}" in out  # names the holder


def test_a_controller_whose_port_is_taken_exits_before_touching_anything(stack, tmp_path: Path) -> None:
    """Another store (so the one-controller lock lets it through), the running controller's
    port: refused before it attaches, re-applies a plan or starts a tune (uvicorn used to bind
    last, after all of that), naming the port and the option; the running one still answers."""
    _, ctl, _, _ = stack
    other_store = tmp_path / "other-store"
    other_store.mkdir()
    second = Ctl(ctl.server, other_store, tmp_path / "state3")
    proc = second.spawn(port=ctl.port)
    assert proc.wait(timeout=60) == 1
    out = (tmp_path / "state3" / "controller.out").read_text()
    assert f"cannot listen on 127.0.0.1:{ctl.port}" in out and "--port" in out, out
    assert "version" not in out and "tuning every" not in out, out  # nothing attached or started
    assert not (tmp_path / "state3" / "swaps.jsonl").exists()
    assert ctl.get("/healthz").status_code == 200


def test_api_fuzz_answers_only_documented_statuses(stack) -> None:
    """schemathesis against the live controller's own spec: every operation, valid and
    invalid inputs, with the token; never a 5xx, only statuses the spec lists, the
    declared content type, and a 401 whenever the token is left out."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        ignored_auth,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    _, ctl, _, bystander = stack
    schema = schemathesis.openapi.from_url(f"{ctl.url}/openapi.json")
    headers = ctl.server.management_headers()
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance, ignored_auth]
    seen: dict[int, int] = {}
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 11
    passes = []
    for op in operations:
        passes += [(op, GenerationMode.POSITIVE, None), (op, GenerationMode.NEGATIVE, None)]
        # The real model too, where that changes nothing (no swap, no profiling job).
        if "{model}" in op.path and (op.method.upper() == "GET" or op.path.endswith("/plan")):
            passes.append((op, GenerationMode.POSITIVE, {"model": VICTIM}))
    for op, mode, path_parameters in passes:
        if True:
            @given(case=op.as_strategy(generation_mode=mode, path_parameters=path_parameters))
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case) -> None:
                r = case.call_and_validate(headers=headers, checks=checks, timeout=60)
                seen[r.status_code] = seen.get(r.status_code, 0) + 1

            try:
                run()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # nothing to get wrong (no parameters, no body)
    print(f"{sum(seen.values())} fuzzed calls over {len(operations)} operations: {sorted(seen.items())}")
    assert not [c for c in seen if c >= 500]
    assert_bystander_untouched(bystander)


def own_settings(box: dict, store: Path, tmp_path: Path, **kw) -> ControllerSettings:
    """An in-process controller's settings for the module's server, with a state dir of its own."""
    server = box["server"]
    return ControllerSettings(management_url=server.management_url, key_file=server.key_file,
                              model_store=store, state_dir=tmp_path / "state", cores=usable_cores(2), **kw)


@contextlib.contextmanager
def in_process(ctl: Ctl, settings: ControllerSettings, **kw) -> Iterator[Controller]:
    """A Controller in this process instead of the module's subprocess one, holding the
    model store's lock as any controller must (one per TorchServe): the subprocess
    controller is stopped meanwhile and started again after."""
    ctl.kill()
    c = Controller(settings, **kw)
    c.acquire()
    try:
        yield c
    finally:
        c.release()
        ctl.start()


def test_a_request_that_is_not_valid_http_gets_the_documented_400(stack) -> None:
    """What the fuzzer found once (a Content-Length that is not a number): the HTTP server
    refuses the request with a 400 before any route, so every route's spec lists 400 (the
    fuzz test's status check would fail on it otherwise), and the controller answers on."""
    import socket
    from urllib.parse import urlsplit

    _, ctl, _, _ = stack
    where = urlsplit(ctl.url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as conn:
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0S7C\r\n\r\n")
        status_line = conn.recv(4096).split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 400"), status_line
    spec = requests.get(f"{ctl.url}/openapi.json", timeout=30).json()
    operations = [(method, path, op) for path, ops in spec["paths"].items() if path.startswith("/v1/")
                  for method, op in ops.items()]
    assert len(operations) >= 11
    assert [(m, p) for m, p, op in operations if "400" not in op["responses"]] == []
    assert ctl.get("/healthz").status_code == 200


def test_tick_survives_any_exception(stack, tmp_path: Path) -> None:
    box, ctl, store, _ = stack
    calls = []

    class Exploding:
        """A policy with a bug: every call raises something no code path expects."""

        def __call__(self, ctx, state):
            calls.append(ctx.model)
            raise ZeroDivisionError("policy bug")

        def metrics_text(self) -> bytes:
            return b""

    with in_process(ctl, own_settings(box, store, tmp_path, tick_s=0.05), policy=Exploding()) as c:
        stop = threading.Event()
        t = threading.Thread(target=c.run, args=(stop,), daemon=True)
        t.start()
        wait_for(lambda: len(calls) >= 6, 120, "six policy calls")
        assert t.is_alive()  # every exception was caught; the loop goes on
        stop.set()
        t.join(timeout=60)
    assert {VICTIM, BYSTANDER} <= set(calls)  # one model's failure does not starve the other
    text = c.metrics_text().decode()
    line = next(x for x in text.splitlines() if x.startswith("packrat_controller_tick_errors_total"))
    assert float(line.split()[-1]) >= 6


def test_the_restart_watch_leaves_the_swap_lock_alone_while_nothing_is_lost(stack, tmp_path: Path) -> None:
    # It ran every tick under the swap lock, describe calls included, so an apply that
    # arrived meanwhile got 409 "a swap is already running" with no swap running.
    box, ctl, store, _ = stack
    with in_process(ctl, own_settings(box, store, tmp_path)) as c:
        live = c.client.describe(VICTIM)["modelVersion"]
        (tmp_path / "state" / "last-plans.json").write_text(json.dumps(
            {VICTIM: {"version": live, "url": f"{VICTIM}.{live}", "plan": {"instances": TWO}}}))

        class CountingLock:
            def __init__(self) -> None:
                self.lock, self.taken = threading.Lock(), 0

            def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
                self.taken += 1
                return self.lock.acquire(blocking, timeout)

            def release(self) -> None:
                self.lock.release()

        lock = c.swaps.lock = CountingLock()
        assert c.watch([VICTIM]) == []
        assert lock.taken == 0


def test_status_names_a_last_plan_whose_version_is_no_longer_loaded(stack, tmp_path: Path) -> None:
    """Right after a restart every model read "applied <the tune's choice>" for ~20 s while
    the base version served and the restart watch had still to apply that plan again."""
    box, ctl, store, _ = stack
    with in_process(ctl, own_settings(box, store, tmp_path)) as c:
        live = c.client.describe(VICTIM)["modelVersion"]
        last = tmp_path / "state" / "last-plans.json"
        plan = {"cores": 2, "batch": 2, "predicted_latency_ms": 0.0, "mode": "fp32-eager",
                "instances": [{"threads": 1, "batch": 1, "latency_ms": 0.0}] * 2}
        last.write_text(json.dumps({VICTIM: {"version": "p999", "url": f"{VICTIM}.p999", "plan": plan}}))
        status = render_status(c.status(VICTIM))  # read before any tick: nothing applied it yet
        assert status["lost_plan"]["version"] == "p999" and status["lost_plan"]["plan"] == plan, status
        assert status["lost_plan"]["retry_in_s"] == 0.0
        assert stage_text(status).startswith(
            "to apply its last plan again (fp32-eager 2x(t1,b1): version p999 is no longer loaded); tune: ")
        # Its version loaded (the default here): nothing to say.
        last.write_text(json.dumps({VICTIM: {"version": live, "url": VICTIM, "plan": plan}}))
        assert render_status(c.status(VICTIM))["lost_plan"] is None


def test_status_shows_the_running_swap_and_a_second_apply_gets_409(stack) -> None:
    _, ctl, store, bystander = stack
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(r=ctl.apply(TWO)))
    t.start()
    wait_for(lambda: ctl.status()["swap_in_progress"] is not None, 30, "the swap to show in status")
    running = ctl.status()["swap_in_progress"]
    assert running["model"] == VICTIM and running["outcome"] == "running"
    r = ctl.apply(ONE)
    assert r.status_code == 409, r.text
    assert r.json()["error"] == "BusyError"
    # The phases status shows while the swap runs go forward in the documented order
    # (polling may miss some, never reverse them).
    seen = [running["phase"]]
    while t.is_alive():
        status = ctl.status()
        phase = (status["swap_in_progress"] or {}).get("phase")
        if phase is not None:  # `packrat status` leads with it, from the wire form as it is
            assert stage_text(status).startswith(f"swapping to {shape_text(status['swap_in_progress']['plan'])}"), status
        if phase is not None and phase != seen[-1]:
            seen.append(phase)
        time.sleep(0.05)
    assert all(p in SWAP_PHASES for p in seen), seen
    assert [SWAP_PHASES.index(p) for p in seen] == sorted({SWAP_PHASES.index(p) for p in seen}), seen
    t.join(timeout=300)
    assert first["r"].status_code == 200, first["r"].text
    assert_recovered(ctl, store, TWO)
    assert_bystander_untouched(bystander)


@pytest.mark.parametrize("how", ["one", "all"])
def test_killed_workers_are_replaced_as_planned(stack, how: str) -> None:
    box, ctl, store, bystander = stack
    before = on_plan(ctl, store, TWO)
    pids = [w["pid"] for w in before["workers"]]
    victims = pids[:1] if how == "one" else pids
    load = sleep_load(box["server"], VICTIM)
    with load:
        time.sleep(0.5)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        after = assert_recovered(ctl, store, TWO, gone=set(victims))
        time.sleep(0.5)
    assert after["version"] == before["version"]  # TorchServe restarted them; no swap needed
    failed = [s for s in load.samples if not s.ok]
    # Only a killed worker's own batch (cap 1) may fail.
    assert len(failed) <= len(victims), [s.error for s in failed]
    assert_bystander_untouched(bystander)


@pytest.mark.parametrize("phase", ["ready", "drain"])
def test_controller_killed_in_a_swap_phase_recovers(stack, phase: str) -> None:
    box, ctl, store, bystander = stack
    server = box["server"]
    # Swap to the other shape (TWO -> ONE, then ONE -> TWO) under load on both models.
    src = live_shape(ctl) or TWO
    dst = ONE if src is TWO else TWO
    on_plan(ctl, store, src)
    load = sleep_load(server, VICTIM).start()
    answers: dict = {}
    threading.Thread(target=lambda: answers.update(apply=_quiet(ctl.apply, dst)), daemon=True).start()
    wait_for(lambda: (ctl.status()["swap_in_progress"] or {}).get("phase") == phase, 120, f"phase {phase}")
    seen = len(ctl.log(tail=10**9).splitlines())  # the log is appended to across restarts
    ctl.kill()
    ctl.start()  # attach finishes the half-done swap
    # Killed before set-default the old shape stays; after it, the new one.
    st = assert_recovered(ctl, store, src if phase == "ready" else dst)
    # ... and says which version it retired and why: the one loaded beside the default.
    retired = [line for line in ctl.log(tail=10**9).splitlines()[seen:] if line.startswith(f"attach: {VICTIM} ")]
    assert retired and all("retired (loaded beside the default version" in line for line in retired), ctl.log()
    assert all(line.split()[2] != f"{st['version']}:" for line in retired), (st["version"], retired)
    load.stop()
    assert not load.failures(), load.failures()[:3]
    # The restart watch re-applies the plan in last-plans.json when its version is gone:
    # attach recorded the version it settled on, so the watch keeps it.
    assert last_plan_version(ctl) == st["version"]
    assert_bystander_untouched(bystander)


def scale_to_zero_as_retire_does(client, version: str, attempts: int = 5) -> None:
    """TorchServe 0.12 may answer a scale-down racing a held job with HTTP 500 ("Cannot
    invoke Job.isControlCmd() because job is null"; seen once in a shuffled run):
    retire() then tries again (packrat.apply.swap.Swapper._scale_to_zero), and so does this."""
    for attempt in range(attempts):
        try:
            client.scale(VICTIM, version, 0)
            return
        except TorchServeError as exc:
            if exc.status < 500 or attempt == attempts - 1:
                raise
            time.sleep(1.0)


def test_controller_killed_in_retire_after_scale_to_zero_recovers(stack) -> None:
    """The retire phase lasts milliseconds unless jobs come back, so its kill is staged:
    the controller dies, then the state its retire() leaves after "scale to 0" is made
    by hand: the old version not default, no workers, a job in its queue."""
    box, ctl, store, bystander = stack
    server = box["server"]
    client = server.management_client()
    src = on_plan(ctl, store, live_shape(ctl) or TWO)
    old = src["version"]
    ctl.kill()
    base = versions.load_version(store / src["url"]).base
    plan = Plan(cores=2, batch=1, instances=(Instance(1, 1, 0.0),) * 2, predicted_latency_ms=0.0)
    new = versions.create_version(store, base, VICTIM, plan, list(usable_cores(2)))
    client.register(new.url, VICTIM, 2)
    wait_for(lambda: [w["status"] for w in client.describe(VICTIM, new.version)["workers"]] == ["READY"] * 2,
             120, "the new version's workers")
    client.set_default(VICTIM, new.version)
    # One old worker holds job a unread (stopped); job b waits in the queue behind it.
    pids = [w["pid"] for w in client.describe(VICTIM, old)["workers"]]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    url = f"{server.inference_url}/predictions/{VICTIM}/{old}"
    answers: dict = {}

    def send(key: str) -> None:
        answers[key] = requests.post(url, data=key.encode(), headers=server.inference_headers(),
                                     timeout=120).status_code

    held = [threading.Thread(target=send, args=(f"a{i}",)) for i in range(len(pids))]
    for t in held:
        t.start()
    # pendingRequests is 0 before the a's reach the queue too: wait until each sits unread
    # in its worker's socket.
    wait_for(lambda: client.describe(VICTIM, old)["jobQueueStatus"]["pendingRequests"] == 0
             and holding_unread(pids), 30, "a taken")
    held.append(threading.Thread(target=send, args=("b",)))
    held[-1].start()
    wait_for(lambda: client.describe(VICTIM, old)["jobQueueStatus"]["pendingRequests"] == 1, 30, "b queued")
    scale_to_zero_as_retire_does(client, old)  # where the killed controller's retire() had got to
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert client.describe(VICTIM, old)["jobQueueStatus"]["pendingRequests"] >= 1
    ctl.start()  # attach: retire() scales the old version up, serves b, unregisters it
    assert_recovered(ctl, store, TWO)
    for t in held:
        t.join(timeout=120)
    assert answers["b"] == 200
    # The a's were in flight on workers the staged scale-down killed: TorchServe puts such
    # a job back into the queue (served then) or answers 500 "Worker died." (a race in
    # its WorkerThread.shutdown); either way it is answered.
    assert all(answers[f"a{i}"] in (200, 500) for i in range(len(pids))), answers
    assert last_plan_version(ctl) == new.version  # the restart watch keeps what attach settled on
    assert_bystander_untouched(bystander)


def _quiet(fn, *args):
    try:
        return fn(*args).status_code
    except requests.RequestException as exc:  # the controller was killed mid-call
        return repr(exc)


def test_torchserve_restart_reapplies_the_last_plan(own_stack) -> None:
    """On its own TorchServe: stopping it stops the bystander too."""
    box, ctl, store, bystander = own_stack
    before = on_plan(ctl, store, TWO)
    bystander.stop()
    assert not bystander.failures(), bystander.failures()[:3]
    old = box["server"]
    old.stop()
    # The same TorchServe again (ports, store, workdir), loading the base models only.
    box["server"] = ctl.server = new = start_server(store, old.workdir, ports=old.ports,
                                                    models=[VICTIM, BYSTANDER])
    wait_for(lambda: len(new.management_client().describe(VICTIM)["workers"]) >= 1, 60, "the base model")
    # The controller notices that the version of its last swap is gone and applies the plan again.
    after = assert_recovered(ctl, store, TWO, timeout_s=120)
    assert after["lost_plan"] is None, after  # applied again: nothing is lost any more
    # Applied again from the base model TorchServe loaded (version numbers may repeat:
    # the lost version's directory was removed first).
    last = json.loads((ctl.state / "swaps.jsonl").read_text().splitlines()[-1])
    assert last["outcome"] == "applied" and last["from_version"] != before["version"]
    assert last["to_version"] == after["version"]
    metrics = requests.get(f"{ctl.url}/metrics", timeout=10).text
    assert f'packrat_controller_reapplies_total{{model="{VICTIM}"}} 1.0' in metrics
    r = requests.post(f"{new.inference_url}/predictions/{VICTIM}", data=b"x", headers=new.inference_headers(),
                      timeout=60)
    assert r.status_code == 200
