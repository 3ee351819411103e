"""The Packrat endpoint plugin: the controller's API on TorchServe's management port.

A real TorchServe loads plugin/build/packrat-plugin.jar (plugins_path from the
repo's config.properties, scripts/build_plugin.sh builds it); a real `packrat
controller` subprocess listens on a free loopback port that the server's
`packrat_controller_url` names. Every call goes both ways, through
`<management>/packrat/...` and straight to `<controller>/v1/...`, and the
answers must agree.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from packrat.profile.store import save_profile
from packrat.server import RunningServer, free_ports
from packrat.types import Profile, ProfilePoint
from serving_support import ControllerProcess, python_for, registered_with_controller, start_server
from waiting import wait_until

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "scripts" / "build_plugin.sh"
JAR = REPO / "plugin" / "build" / "packrat-plugin.jar"
MODEL = "plug-echo"
BODY_HEADER = "X-Packrat-Body"
# TorchServe 0.12's refusal of a missing or wrong key: TokenAuthorizationHandler
# throws InvalidKeyException, which its HttpRequestHandler maps to 400.
REFUSED = (400, "InvalidKeyException")


class Controller(ControllerProcess):
    """One `packrat controller` subprocess on a fixed port; restartable."""

    def __init__(self, server: RunningServer, store: Path, state: Path, port: int) -> None:
        # The re-plan loop runs (its adapt endpoints answer), but never swaps on its own here.
        super().__init__(server, store, state, ["--min-dwell", "86400", "--no-tune"], port=port)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    subprocess.run([str(BUILD)], check=True)
    if not JAR.exists():
        pytest.skip("javac not found: the plugin was not built (scripts/build_plugin.sh)")
    from packrat.archive import build_named

    store = tmp_path_factory.mktemp("plug-store")
    build_named("noop", store, MODEL)
    port = free_ports(1)[0]
    # The repo's config.properties: its plugins_path loads the plugin.
    server = start_server(store, tmp_path_factory.mktemp("plug-ts"),
                          extra_properties={"packrat_controller_url": f"http://127.0.0.1:{port}"})
    ctl = Controller(server, store, tmp_path_factory.mktemp("plug-state"), port)
    with registered_with_controller(server, ctl, MODEL) as running:
        yield running


def via_plugin(server: RunningServer, method: str, path: str, body: object = None,
               headers: dict | None = None, timeout: float = 300) -> requests.Response:
    """A call to <management>/packrat<path>, its JSON body in the X-Packrat-Body header."""
    h = dict(server.management_headers() if headers is None else headers)
    if body is not None:
        h[BODY_HEADER] = json.dumps(body)
    return requests.request(method, f"{server.management_url}/packrat{path}", headers=h, timeout=timeout)


def both(server: RunningServer, ctl: Controller, method: str, path: str,
         body: object = None) -> tuple[requests.Response, requests.Response]:
    """The same call through the plugin and straight to the controller (body as the body)."""
    a = via_plugin(server, method, path, body)
    b = requests.request(method, f"{ctl.url}/v1{path}", json=body, headers=server.management_headers(),
                         timeout=300)
    return a, b


def assert_same(a: requests.Response, b: requests.Response) -> None:
    assert (a.status_code, a.headers.get("content-type"), a.content) == (
        b.status_code, b.headers.get("content-type"), b.content)


def test_plugin_answers_as_the_controller_port(stack) -> None:
    server, ctl = stack
    # The same bytes, status and content type for reads, computed plans and errors.
    save_profile(Profile(model_id="test", points=tuple(
        ProfilePoint(threads=t, batch=b, mean_ms=10.0 * b / t) for t in (1, 2) for b in (1, 2))),
        ctl.state / "profiles" / f"{MODEL}.json")
    calls = [
        ("GET", "/models", None, 200),
        ("POST", f"/models/{MODEL}/plan", {"batch": 2}, 200),
        ("POST", f"/models/{MODEL}/plan", {"batch": 0}, 422),  # the body reaches the controller
        ("GET", "/models/no-such-model/status", None, 404),
        ("GET", "/swaps?last=1", None, 200),  # the query too
        ("GET", "/jobs/nope", None, 404),
    ]
    for method, path, body, code in calls:
        a, b = both(server, ctl, method, path, body)
        assert a.status_code == code, (path, a.text)
        assert_same(a, b)

    # Apply through the plugin: the controller swapped, and says the same on its own port.
    r = via_plugin(server, "POST", f"/models/{MODEL}/apply", {"instances": [{"threads": 1, "batch": 1}]})
    assert r.status_code == 200, r.text
    swap = r.json()["swap"]
    assert swap["outcome"] == "applied"
    a, b = both(server, ctl, "GET", "/swaps?last=1")
    assert_same(a, b)
    assert a.json() == [swap]
    a, b = both(server, ctl, "GET", f"/models/{MODEL}/status")
    assert a.status_code == 200 and a.headers["content-type"] == b.headers["content-type"]
    # Worker memory, the observed-latency window and the re-plan loop's decisions (one
    # per tick) move between two calls: compare the rest.
    sa, sb = a.json(), b.json()
    for s in (sa, sb):
        s.pop("observed")
        s["adapt"] = s["adapt"]["enabled"]
        for w in s["workers"]:
            w.pop("memoryUsage", None)
    assert sa == sb and sa["version"] == swap["to_version"]

    # Adapt: PUT with a body, then both ports report it.
    a, b = both(server, ctl, "PUT", f"/models/{MODEL}/adapt", {"enabled": False})
    assert a.status_code == 200, a.text
    assert_same(a, b)
    a, b = both(server, ctl, "GET", f"/models/{MODEL}/adapt")
    assert (a.status_code, a.json()["enabled"]) == (b.status_code, b.json()["enabled"]) == (200, False)

    # Profile: a background job through the plugin, polled through the plugin.
    r = via_plugin(server, "POST", f"/models/{MODEL}/profile", {"max_batch": 1, "budget_s": 20, "cores": 1})
    assert r.status_code == 202, r.text
    job = r.json()

    def finished() -> dict | None:
        now = via_plugin(server, "GET", f"/jobs/{job['id']}").json()
        return now if now["state"] not in ("queued", "running") else None

    job = wait_until(finished, 600, "the profiling job (a 20 s budget) to finish")
    assert job["state"] == "done", job
    a, b = both(server, ctl, "GET", f"/jobs/{job['id']}")
    assert_same(a, b)

    # /packrat/metrics is the controller's /metrics (Prometheus text).
    a = via_plugin(server, "GET", "/metrics")
    b = requests.get(f"{ctl.url}/metrics", timeout=30)
    assert a.status_code == 200 and a.headers["content-type"] == b.headers["content-type"]
    assert "packrat_adapt_enabled" in a.text


def test_refused_without_the_management_key(stack) -> None:
    server, ctl = stack
    swaps = requests.get(f"{ctl.url}/v1/swaps", headers=server.management_headers(), timeout=30).json()
    wrong = [{}, {"Authorization": "Bearer nope"}, server.inference_headers(),
             {"Authorization": server.management_headers()["Authorization"].replace("Bearer", "Basic")}]
    for headers in wrong:
        for method, path, body in [("GET", f"/models/{MODEL}/status", None),
                                   ("POST", f"/models/{MODEL}/apply", {"instances": [{"threads": 2, "batch": 1}]})]:
            r = via_plugin(server, method, path, body, headers=headers, timeout=30)
            assert (r.status_code, r.json().get("type")) == REFUSED, (headers, r.status_code, r.text)
    # Nothing reached the controller's apply.
    assert requests.get(f"{ctl.url}/v1/swaps", headers=server.management_headers(), timeout=30).json() == swaps


def test_a_request_body_is_refused_not_forwarded(stack) -> None:
    """TorchServe 0.12 frees a plugin request's body before the plugin runs: the
    plugin refuses every body (400 naming the header to use), never forwards one."""
    server, ctl = stack
    swaps = requests.get(f"{ctl.url}/v1/swaps", headers=server.management_headers(), timeout=30).json()
    for _ in range(5):  # reading it would sometimes work: refusing must be every time
        r = requests.post(f"{server.management_url}/packrat/models/{MODEL}/apply",
                          json={"instances": [{"threads": 2, "batch": 1}]},
                          headers=server.management_headers(), timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "BodyNotSupported", r.text
        assert BODY_HEADER in r.json()["message"]
    assert requests.get(f"{ctl.url}/v1/swaps", headers=server.management_headers(), timeout=30).json() == swaps
    # No body (POST with defaults) is fine: the controller answers (here: no such job route body needed).
    r = via_plugin(server, "POST", "/models/no-such-model/profile")
    assert r.status_code == 404 and "no-such-model" in r.json()["detail"]


def test_controller_stopped_503_and_inference_continues(stack) -> None:
    server, ctl = stack
    ctl.kill()
    try:
        r = requests.get(f"{server.management_url}/packrat/models/{MODEL}/status",
                         headers=server.management_headers(), timeout=30)
        assert r.status_code == 503 and r.headers["content-type"].startswith("application/json"), r.text
        assert "not reachable" in r.json()["message"] and ctl.url in r.json()["message"]
        # A call without the key is still TorchServe's refusal: it never got to the plugin.
        r = requests.get(f"{server.management_url}/packrat/models/{MODEL}/status", timeout=30)
        assert (r.status_code, r.json().get("type")) == REFUSED
        # TorchServe serves on: inference and its own management API.
        r = requests.post(f"{server.inference_url}/predictions/{MODEL}", data=b"still here",
                          headers=server.inference_headers(), timeout=60)
        assert (r.status_code, r.content) == (200, b"still here")
        assert requests.get(f"{server.management_url}/models", headers=server.management_headers(),
                            timeout=30).status_code == 200
    finally:
        ctl.start()
    r = requests.get(f"{server.management_url}/packrat/models/{MODEL}/status",
                     headers=server.management_headers(), timeout=30)
    assert r.status_code == 200, r.text


# Another local user's process on the controller's port: it answers any HTTP request with
# 200 and prints, one line each, the bytes every connection sent it.
SQUATTER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(5)
    try:
        data = c.recv(65536)
    except OSError:
        data = b""
    print(repr(data), flush=True)
    c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
    c.close()
"""
NOBODY_UID = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="starting another user's listener needs root")
def test_a_squatter_on_the_controller_port_gets_no_key(stack) -> None:
    """While the controller is down, another user takes its port: the plugin refuses to
    call it (TorchServe's own user or root only), so the management key never reaches it."""
    server, ctl = stack
    key = server.management_headers()["Authorization"].split()[-1]
    python = python_for(NOBODY_UID)
    ctl.kill()
    try:
        for address in ("127.0.0.1", "0.0.0.0"):  # the controller's address, and the wildcard
            squatter = subprocess.Popen([python, "-c", SQUATTER, address, str(ctl.port)],
                                        user=NOBODY_UID, group=NOBODY_UID, stdout=subprocess.PIPE, text=True)
            try:
                assert squatter.stdout.readline().strip() == "listening"
                r = via_plugin(server, "POST", f"/models/{MODEL}/apply",
                               {"instances": [{"threads": 1, "batch": 1}]}, timeout=30)
                assert r.status_code == 503 and r.json()["type"] == "ControllerNotTrusted", r.text
                assert f"uid {NOBODY_UID}" in r.json()["message"] and ctl.url in r.json()["message"]
                # The squatter answers whoever connects: it is a working listener.
                assert requests.get(f"http://127.0.0.1:{ctl.port}/v1/models", timeout=10).status_code == 200
            finally:
                squatter.kill()
                received, _ = squatter.communicate(timeout=10)
            lines = received.splitlines()
            assert len(lines) == 1 and "Authorization" not in lines[0] and key not in received, received
    finally:
        ctl.start()
    # The controller again, as TorchServe's user: the key goes to it.
    r = requests.get(f"{server.management_url}/packrat/models/{MODEL}/status",
                     headers=server.management_headers(), timeout=30)
    assert r.status_code == 200, r.text


def test_make_rebuilds_the_jar_when_a_source_changes() -> None:
    source = next((REPO / "plugin" / "src").rglob("*.java"))
    rel_jar = JAR.relative_to(REPO)
    # -q: exit 1 if the target would be remade; -W: as if the source had just changed.
    changed = subprocess.run(["make", "-q", "-W", str(source.relative_to(REPO)), str(rel_jar)], cwd=REPO)
    assert changed.returncode == 1


def test_build_without_javac_says_so_and_succeeds(tmp_path: Path) -> None:
    """Only a Java runtime: the build prints what to install and exits 0 (setup goes on)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(BUILD, tmp_path / "scripts")
    shutil.copytree(REPO / "plugin" / "src", tmp_path / "plugin" / "src")
    shutil.copytree(REPO / "plugin" / "resources", tmp_path / "plugin" / "resources")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "find", "cat", "java"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    r = subprocess.run([str(tmp_path / "scripts" / "build_plugin.sh")], env={"PATH": str(bin_dir)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "javac not found" in r.stderr and "8085" in r.stderr
    assert not (tmp_path / "plugin" / "build").exists()


def test_torchserve_start_points_the_plugin_at_the_controller_url_it_is_given(tmp_path: Path) -> None:
    """`make run` with PACKRAT_FREE_PORTS=1 starts its controller on a free port and tells
    TorchServe's plugin where (`packrat torchserve start --controller-url`); the plugin
    forwarded to 8085 whatever port the controller had before. The model named by --models
    is loaded at start, and `packrat torchserve register` waits for its worker."""
    subprocess.run([str(BUILD)], check=True)
    if not JAR.exists():
        pytest.skip("javac not found: the plugin was not built (scripts/build_plugin.sh)")
    from packrat.archive import build_named

    store, work = tmp_path / "store", tmp_path / "ts"
    build_named("noop", store, MODEL)
    url = f"http://127.0.0.1:{free_ports(1)[0]}"
    cli = [sys.executable, "-m", "packrat.cli", "torchserve"]
    start = subprocess.run(cli + ["start", "--workdir", str(work), "--model-store", str(store), "--config",
                                  str(REPO / "config.properties"), "--free-ports", "--controller-url", url,
                                  "--models", MODEL], capture_output=True, text=True, timeout=240)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        server = RunningServer.attach(work)
        # No controller listens there: the plugin's 503 names the URL it was given.
        r = requests.get(f"{server.management_url}/packrat/models", headers=server.management_headers(), timeout=30)
        assert r.status_code == 503 and url in r.json()["message"], r.text
        assert "8085" not in r.json()["message"]
        # Loaded at start (--models, as make run does), so `register` waits for its worker instead.
        reg = subprocess.run(cli + ["register", "--workdir", str(work), MODEL], capture_output=True, text=True,
                             timeout=240)
        assert reg.returncode == 0 and f"{MODEL}: already registered, a worker READY" in reg.stdout, \
            reg.stdout + reg.stderr
        assert [w["status"] for w in server.management_client().describe(MODEL)["workers"]] == ["READY"]
    finally:
        subprocess.run(cli + ["stop", "--workdir", str(work)], capture_output=True, timeout=120)
