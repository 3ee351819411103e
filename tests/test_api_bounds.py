"""Issue 31, bounds and small holes, through a real `packrat controller` beside a real TorchServe.

- Every bound on an authenticated call (batch, threads, cores, budget_s, last) is
  answered 422 naming the limit, and nothing is pinned, queued or swapped.
- A management key past its expiration time (TorchServe could not rotate it) is refused
  with 401 saying how to get a fresh one; the key back in date opens /v1 again.
- A version whose model_config.yaml does not parse does not stop the controller at
  attach: it starts, names that model broken, and serves and swaps the other.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import requests

from packrat.api.requests import MAX_BATCH, MAX_LAST, MAX_PROFILE_BUDGET_S
from packrat.apply import versions
from serving_support import ControllerProcess, registered_with_controller, start_server, usable_cores

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]

SERVED = "bounds-a"  # keeps being served and swapped
VICTIM = "bounds-b"  # gets a broken version config
ONE = [{"threads": 1, "batch": 1}]


@pytest.fixture(scope="module")
def stack(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory):
    store, state = tmp_path_factory.mktemp("bounds-store"), tmp_path_factory.mktemp("bounds-state")
    for name in (SERVED, VICTIM):
        (store / name).symlink_to(tiny_store / "noop", target_is_directory=True)
    server = start_server(store, tmp_path_factory.mktemp("bounds-ts"))
    ctl = ControllerProcess(server, store, state, ["--no-adapt", "--no-tune"], ready_path="/healthz")
    server.management_client().register(VICTIM, VICTIM, 1)
    with registered_with_controller(server, ctl, SERVED):
        yield server, ctl, store


def call(ctl: ControllerProcess, method: str, path: str, body: object = None, **kw) -> requests.Response:
    return requests.request(method, f"{ctl.url}{path}", json=body, headers=kw.pop("headers", ctl.headers()),
                            timeout=300, **kw)


def status(ctl: ControllerProcess, model: str) -> dict:
    r = call(ctl, "GET", f"/v1/models/{model}/status")
    assert r.status_code == 200, r.text
    return r.json()


# (method, path, body, the field and the limit the 422 must name)
OUT_OF_BOUNDS = [
    ("POST", f"/v1/models/{SERVED}/apply", {"instances": [{"threads": 1, "batch": 100_000_000}]}, "batch", MAX_BATCH),
    ("POST", f"/v1/models/{SERVED}/apply", {"batch": 100_000_000}, "batch", MAX_BATCH),
    ("POST", f"/v1/models/{SERVED}/apply", {"instances": [{"threads": 100_000, "batch": 1}]}, "threads", 1024),
    ("POST", f"/v1/models/{SERVED}/plan", {"batch": 100_000_000}, "batch", MAX_BATCH),
    ("POST", f"/v1/models/{SERVED}/plan", {"batch": 2, "cores": 100_000}, "cores", 1024),
    ("POST", f"/v1/models/{SERVED}/profile", {"budget_s": None}, "budget_s", "number"),
    ("POST", f"/v1/models/{SERVED}/profile", {"budget_s": 1e9}, "budget_s", int(MAX_PROFILE_BUDGET_S)),
    ("POST", f"/v1/models/{SERVED}/profile", {"budget_s": 0}, "budget_s", "greater than 0"),
    ("POST", f"/v1/models/{SERVED}/profile", {"max_batch": 100_000}, "max_batch", MAX_BATCH),
    ("POST", f"/v1/models/{SERVED}/tune", {"modes": ["x" * 1000]}, "modes", 64),
    ("GET", "/v1/swaps?last=0", None, "last", "greater than or equal to 1"),
    ("GET", "/v1/swaps?last=100000000", None, "last", MAX_LAST),
    ("GET", "/v1/jobs?last=0", None, "last", "greater than or equal to 1"),
    ("GET", f"/v1/models/{SERVED}/adapt?last=0", None, "last", "greater than or equal to 1"),
]


def test_each_bound_is_a_422_naming_it_and_nothing_is_applied(stack) -> None:
    _, ctl, store = stack
    # Compared before and after, so the tests pass in any order (make test-random).
    before = status(ctl, SERVED)
    swaps, jobs = call(ctl, "GET", "/v1/swaps").json(), call(ctl, "GET", "/v1/jobs").json()
    dirs = sorted(store.glob(f"{SERVED}.p*"))
    for method, path, body, field, limit in OUT_OF_BOUNDS:
        r = call(ctl, method, path, body)
        assert r.status_code == 422, (method, path, body, r.status_code, r.text)
        errors = r.json()["detail"]
        assert any(field in map(str, e["loc"]) and str(limit) in e["msg"] for e in errors), (path, body, errors)
    # More threads than this controller's usable cores: refused before a pin or a swap, naming both.
    cores = len(usable_cores(2))
    r = call(ctl, "POST", f"/v1/models/{SERVED}/apply", {"instances": [{"threads": 1, "batch": 1}] * (cores + 1)})
    assert r.status_code == 422, r.text
    assert f"{cores + 1} threads" in r.json()["detail"] and f"{cores} usable cores" in r.json()["detail"]
    # Nothing swapped, pinned, queued or created.
    after = status(ctl, SERVED)
    assert (after["version"], after["plan"], after["pin"]) == (before["version"], before["plan"], before["pin"])
    assert call(ctl, "GET", "/v1/swaps").json() == swaps
    assert call(ctl, "GET", "/v1/jobs").json() == jobs
    assert sorted(store.glob(f"{SERVED}.p*")) == dirs
    # At the bound, served (the bound is not a blanket refusal).
    assert call(ctl, "GET", f"/v1/swaps?last={MAX_LAST}").status_code == 200


def test_expired_management_key_is_refused_saying_how_to_rotate(stack) -> None:
    server, ctl, _ = stack
    key_file = Path(server.key_file)
    original = key_file.read_text()
    data = json.loads(original)
    key = data["management"]["key"]
    past = (datetime.now(timezone.utc) - timedelta(minutes=5)).isoformat().replace("+00:00", "Z")
    # TorchServe cannot rotate it: the file's key is past its time and the API key minting a
    # new one is refused (what a token API that is down or refusing leaves behind).
    data["management"]["expiration time"] = past
    data["API"]["key"] = "not-the-api-key"
    try:
        key_file.write_text(json.dumps(data))
        r = call(ctl, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 401, r.text
        detail = r.json()["detail"]
        assert "expired" in detail and "restart TorchServe" in detail and "packrat torchserve keys" in detail
        assert r.headers.get("WWW-Authenticate") == "Bearer"
        # A wrong key is told nothing about the right one's expiry.
        r = call(ctl, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "expired" not in r.text
    finally:
        key_file.write_text(original)
    assert call(ctl, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_broken_version_config_at_attach_leaves_the_others_served(stack) -> None:
    server, ctl, store = stack
    r = call(ctl, "POST", f"/v1/models/{VICTIM}/apply", {"instances": ONE, "pin": False})
    assert r.status_code == 200, r.text
    version_dir = store / status(ctl, VICTIM)["url"]  # the Packrat version live now
    config = version_dir / versions.CONFIG
    assert config.is_file() and not config.is_symlink()  # the version's own file, not the archive's
    ctl.kill()
    config.write_text("packrat: [this does not parse\n  batchSize: {\n")
    ctl.start()  # returns once /healthz answers: the controller did not exit at attach
    assert ctl.proc is not None and ctl.proc.poll() is None, ctl.log()
    assert requests.get(f"{ctl.url}/healthz", timeout=60).status_code == 200
    rows = {row["model"]: row for row in call(ctl, "GET", "/v1/models").json()}
    assert "model_config.yaml" in rows[VICTIM]["broken"], rows
    assert rows[SERVED].get("broken") is None and rows[SERVED]["version"], rows
    r = call(ctl, "GET", f"/v1/models/{VICTIM}/status")
    assert r.status_code == 409 and "broken" in r.text and "model_config.yaml" in r.text, r.text
    # The other model: served by TorchServe, and the controller still swaps it.
    assert requests.post(f"{server.inference_url}/predictions/{SERVED}", data=b"x",
                         headers=server.inference_headers(), timeout=120).status_code == 200
    r = call(ctl, "POST", f"/v1/models/{SERVED}/apply", {"instances": ONE, "pin": False})
    assert r.status_code == 200, r.text
    assert status(ctl, SERVED)["plan"]["instances"][0]["threads"] == 1
