"""The controller's guarded edges, without TorchServe: the REST API's token gate and
body limit over real HTTP (uvicorn on a loopback port), and the slot directory's
permissions and symlink refusals (packrat.slots).

The API needs no TorchServe for these: the token is compared with key_file.json
(written here, in TorchServe's format) and a refused request reaches no route.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from pathlib import Path

import pytest
import requests

from packrat import slots
from packrat.errors import ConfigError
from packrat.server import free_ports
from waiting import wait_until

TOKEN = "mgmt-key-0123456789"


def _key_file(path: Path) -> Path:
    path.write_text(json.dumps({
        "management": {"key": TOKEN, "expiration time": "2999-01-01T00:00:00Z"},
        "inference": {"key": "inf-key", "expiration time": "2999-01-01T00:00:00Z"},
        "API": {"key": "api-key"},
    }))
    return path


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory):
    import uvicorn

    from packrat.api import create_app
    from packrat.control import Controller, ControllerSettings

    tmp = tmp_path_factory.mktemp("guard-api")
    (tmp / "store").mkdir()
    # Nothing listens on this management port: a request that got past the guards
    # to a route would fail with 502, which the tests below would see.
    dead = free_ports(1)[0]
    ctl = Controller(ControllerSettings(management_url=f"http://127.0.0.1:{dead}",
                                        key_file=_key_file(tmp / "key_file.json"),
                                        model_store=tmp / "store", state_dir=tmp / "state"))
    port = free_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(create_app(ctl), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return requests.get(f"{url}/metrics", timeout=10).status_code == 200
        except (requests.ConnectionError, requests.Timeout):
            return False

    wait_until(answers, 120, "the API server in this process to answer")
    try:
        yield url, port, ctl
    finally:
        server.should_exit = True
        t.join(timeout=10)


def _raw(port: int, head: bytes, body: bytes = b"", timeout: float = 5.0) -> tuple[int, bytes]:
    """Send raw bytes, return (status, whole answer) once the server answers (or closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def test_token_is_checked_before_the_body_is_parsed(api) -> None:
    url, _, _ = api
    bad = b'{"instances": [[[[[[[[[[[[[[[[[[[[ not json'
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        r = requests.post(f"{url}/v1/models/m/apply", data=bad,
                          headers={**headers, "Content-Type": "application/json"}, timeout=10)
        # Before the gate FastAPI parsed the body first and answered 422 to anyone.
        assert r.status_code == 401, (headers, r.status_code, r.text)
        assert r.headers.get("www-authenticate") == "Bearer"
    # With the token the body is parsed: the same bytes are a 422, not a 401.
    r = requests.post(f"{url}/v1/models/m/apply", data=bad,
                      headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 422, r.text


def test_unauthenticated_request_is_answered_without_its_body(api) -> None:
    _, port, _ = api
    # Announces 1 GB and sends none of it: answered at once, no body read.
    head = (b"POST /v1/models/m/apply HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n")
    status, _ = _raw(port, head)
    assert status in (401, 413)


def test_oversized_bodies_get_413_before_they_are_read(api) -> None:
    from packrat.api import MAX_BODY_BYTES

    url, port, _ = api
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    # Content-Length over the limit: 413 from the header alone (the body is never sent).
    head = (b"POST /v1/models/m/apply HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
            + f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode())
    status, _ = _raw(port, head)
    assert status == 413
    # Chunked, no length: 413 once the chunks pass the limit; the rest is never needed.
    head = (b"POST /v1/models/m/apply HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
            + b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"a" * 16384
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(MAX_BODY_BYTES // len(chunk) + 2))
    status, _ = _raw(port, head, body)  # no final 0-chunk: the server must not wait for the end
    assert status == 413
    # A body under the limit goes through to the route (which then needs TorchServe: 502).
    r = requests.post(f"{url}/v1/models/m/plan", json={"batch": 2},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 502, r.text


def test_open_paths_and_closed_doc_pages(api) -> None:
    url, _, _ = api
    assert requests.get(f"{url}/openapi.json", timeout=10).status_code == 200
    metrics = requests.get(f"{url}/metrics", timeout=10)
    assert metrics.status_code == 200
    assert "packrat_controller_tick_errors_total" in metrics.text
    # /docs and /redoc are off (they would load scripts from a CDN); without a token
    # they are refused like every path that is not open, with one they do not exist.
    for path in ("/docs", "/redoc"):
        assert requests.get(f"{url}{path}", timeout=10).status_code == 401
        assert requests.get(f"{url}{path}", headers={"Authorization": f"Bearer {TOKEN}"},
                            timeout=10).status_code == 404


# -- the slot directory ----------------------------------------------------------------


@pytest.fixture
def slot_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "slots"
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(root))
    return root


def _cfg(plan_id: str = "p-test") -> dict:
    return {"plan_id": plan_id, "slots": [{"cores": [0], "threads": 1}]}


def _release() -> None:
    if slots._held_lock_fd is not None:
        os.close(slots._held_lock_fd)
        slots._held_lock_fd = None


def test_slot_dir_is_created_private(slot_dir: Path) -> None:
    claim = slots.claim_slot(_cfg())
    try:
        assert stat.S_IMODE(os.lstat(slot_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(slot_dir / "p-test").st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(claim.lock_path).st_mode) == 0o600
    finally:
        _release()


def test_slot_dir_readable_by_others_is_tightened(slot_dir: Path) -> None:
    slot_dir.mkdir(mode=0o755)
    os.chmod(slot_dir, 0o755)
    slots.secure_dir(slot_dir)
    assert stat.S_IMODE(os.lstat(slot_dir).st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775, 0o757])
def test_slot_dir_writable_by_others_is_refused(slot_dir: Path, mode: int) -> None:
    slot_dir.mkdir()
    os.chmod(slot_dir, mode)
    with pytest.raises(ConfigError, match="writable by other users"):
        slots.claim_slot(_cfg())
    assert stat.S_IMODE(os.lstat(slot_dir).st_mode) == mode  # left as it was
    assert not (slot_dir / "p-test").exists()


def test_slot_dir_that_is_a_symlink_is_refused(slot_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    slot_dir.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="not a directory"):
        slots.claim_slot(_cfg())
    assert list(elsewhere.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory another user's needs root")
def test_slot_dir_of_another_user_is_refused(slot_dir: Path) -> None:
    slot_dir.mkdir(mode=0o700)
    os.chown(slot_dir, 65534, 65534)  # nobody
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        slots.claim_slot(_cfg())


def test_lock_and_status_files_are_not_followed_through_symlinks(slot_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("precious\n")
    slots.secure_dir(slot_dir)
    slots.secure_dir(slot_dir / "p-test")
    (slot_dir / "p-test" / "slot-0.lock").symlink_to(target)
    with pytest.raises(ConfigError, match="symlink"):
        slots.claim_slot(_cfg())
    assert target.read_text() == "precious\n"  # not truncated through the link

    # A status record behind a symlink (or not ours) is not believed.
    slots.secure_dir(slot_dir / "workers")
    pid = os.getpid()
    fake = tmp_path / "fake.json"
    fake.write_text(json.dumps({"pid": pid, "started": 0, "done": 0, "busy": False}))
    slots.worker_status_path(pid).symlink_to(fake)
    assert slots.read_worker_status(pid) is None
    slots.worker_status_path(pid).unlink()
    slots.worker_status_path(pid).write_text(fake.read_text())
    assert slots.read_worker_status(pid) == json.loads(fake.read_text())
    if os.getuid() == 0:
        os.chown(slots.worker_status_path(pid), 65534, 65534)
        assert slots.read_worker_status(pid) is None
