"""The CLI sends the management key only to a controller of the caller's own user (or
root): another user's listener on the controller's loopback port gets no connection."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from packrat.listener import listener_uids, untrusted_listener
from serving_support import http_stand_in, python_for

KEY = "mgmt-Key_0123456789abcdef"
NOBODY = 65534
SQUATTER = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen()
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
print(repr(c.recv(65536)), flush=True)
"""


def test_own_listener_is_trusted_and_others_hosts_unchecked() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listener_uids("127.0.0.1", port) == [os.geteuid()]
        assert untrusted_listener(f"http://127.0.0.1:{port}/v1/models") is None
    assert listener_uids("127.0.0.1", port) == []  # closed: nothing listens, the call fails as before
    assert untrusted_listener("http://192.0.2.1:8085") is None  # not this machine's loopback


@pytest.mark.skipif(os.geteuid() != 0, reason="starting another user's listener needs root")
@pytest.mark.parametrize("address", ["127.0.0.1", "0.0.0.0"])
def test_cli_refuses_another_users_listener(tmp_path: Path, address: str) -> None:
    squatter = subprocess.Popen([python_for(NOBODY), "-c", SQUATTER, address], user=NOBODY, group=NOBODY,
                                stdout=subprocess.PIPE, text=True)
    try:
        port = int(squatter.stdout.readline())
        assert "uid 65534" in (untrusted_listener(f"http://127.0.0.1:{port}") or "")
        key_file = tmp_path / "key_file.json"
        key_file.write_text(json.dumps({k: {"key": f"{KEY}-{k}"} for k in ("inference", "management", "API")}))
        r = subprocess.run([sys.executable, "-m", "packrat.cli", "status", "--api", f"http://127.0.0.1:{port}",
                            "--key-file", str(key_file)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "uid 65534" in r.stderr and "not sent" in r.stderr, r.stderr
    finally:
        squatter.kill()
        received, _ = squatter.communicate(timeout=10)
    assert received == ""  # no connection at all


def _status(api: str, key_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packrat.cli", "status", "--api", api,
                           "--key-file", str(key_file)], capture_output=True, text=True, timeout=120)


def test_cli_says_plainly_when_nothing_or_something_else_answers(tmp_path: Path) -> None:
    """Nothing on the port: one line with the cause ("Connection refused"), not requests' nested
    repr; another server there (an HTML 404): says it is not the controller's answer instead of
    printing its page, or a traceback where its answer is not JSON."""
    key_file = tmp_path / "key_file.json"
    key_file.write_text(json.dumps({k: {"key": f"{KEY}-{k}"} for k in ("inference", "management", "API")}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens
    r = _status(f"http://127.0.0.1:{port}", key_file)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "does not answer (Connection refused); is `packrat controller` running?" in r.stderr, r.stderr

    page = {"status": 404}
    html = b"<html><body>Nothing matches the given URI</body></html>"
    with http_stand_in(lambda method, path: (page["status"], "text/html", html)) as (url, _):
        for status in (404, 200):
            page["status"] = status
            r = _status(url, key_file)
            assert r.returncode == 1 and "Traceback" not in r.stderr and "<html>" not in r.stderr, r.stderr
            assert f"HTTP {status} from {url}/v1/models is not the " \
                   "controller's answer (no JSON; text/html)" in r.stderr, r.stderr


def test_the_key_goes_to_the_controller_only_not_to_a_proxy_or_a_redirect(tmp_path: Path) -> None:
    """An HTTP proxy named in the environment got the management key for a loopback URL (requests
    sent every call through it); a redirect would carry the key to where it points. The CLI
    goes straight to the listener it checked and follows no redirect."""
    key_file = tmp_path / "key_file.json"
    key_file.write_text(json.dumps({k: {"key": f"{KEY}-{k}"} for k in ("inference", "management", "API")}))
    status = {"model": "m", "version": "p1", "mode": "fp32-eager", "plan": None, "tune": None}

    def controller(method: str, path: str) -> tuple[int, str, bytes]:
        body = [{"model": "m"}] if path == "/v1/models" else status
        return 200, "application/json", json.dumps(body).encode()

    with http_stand_in(controller) as (url, asked), \
            http_stand_in(lambda method, path: (502, "text/plain", b"proxy")) as (proxy, proxied):
        r = subprocess.run([sys.executable, "-m", "packrat.cli", "status", "--api", url, "--key-file", str(key_file)],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "HTTP_PROXY": proxy, "http_proxy": proxy,
                                "NO_PROXY": "", "no_proxy": ""})
        assert r.returncode == 0 and "fp32-eager" in r.stdout, r.stderr
        assert proxied == []
        assert [(m, p) for m, p, _ in asked] == [("GET", "/v1/models"), ("GET", "/v1/models/m/status")]
        assert all(key == f"Bearer {KEY}-management" for _, _, key in asked)

        def moved(method: str, path: str) -> tuple[int, str, bytes, dict[str, str]]:
            return 307, "text/html", b"moved", {"Location": f"{url}{path}"}

        with http_stand_in(moved) as (other, _):
            asked.clear()
            r = _status(other, key_file)
        assert r.returncode == 1, r.stderr
        assert f"HTTP 307 from {other}/v1/models is not the controller's answer" in r.stderr, r.stderr
        assert asked == []  # the redirect's target never saw the request, nor the key


def test_apply_waits_while_another_swap_runs_then_applies(tmp_path: Path) -> None:
    """`packrat apply` answered busy (409 BusyError: a tune's swap runs) asks again once a
    second within --wait, saying so once, and applies; with --wait 0 the 409 is the answer.
    The busy answer is the one the controller's error handler renders for a BusyError."""
    import asyncio
    from packrat.api.answers import render_error
    from packrat.errors import BusyError

    rendered = asyncio.run(render_error(None, BusyError("a swap is already running; try again when it is done")))
    busy = rendered.body
    assert rendered.status_code == 409 and json.loads(busy)["error"] == "BusyError"
    applied = json.dumps({"swap": {"to_version": "p3", "outcome": "applied", "duration_s": 2.5},
                          "plan": {"mode": "fp32-eager", "instances": [{"threads": 1, "batch": 2}] * 2},
                          "pin": None}).encode()
    key_file = tmp_path / "key_file.json"
    key_file.write_text(json.dumps({k: {"key": f"{KEY}-{k}"} for k in ("inference", "management", "API")}))
    posts = [0]

    def answer(method: str, path: str) -> tuple[int, str, bytes]:
        posts[0] += 1
        return (409, "application/json", busy) if posts[0] <= 2 else (200, "application/json", applied)

    def apply(api: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "packrat.cli", "apply", "m", "--shape", "2x(t1,b2)", "--no-pin",
                               *extra, "--api", api, "--key-file", str(key_file)],
                              capture_output=True, text=True, timeout=120)

    with http_stand_in(answer) as (url, asked):
        r = apply(url)
        assert r.returncode == 0 and "m: version p3 fp32-eager 2x(t1,b2): applied in 2.5 s" in r.stdout, r
        assert r.stderr.count("waiting (up to 300 s): a swap is already running") == 1, r.stderr
        assert [path for _, path, _ in asked] == ["/v1/models/m/apply"] * 3
        asked.clear()
        posts[0] = 0
        r = apply(url, "--wait", "0")
        assert r.returncode == 1 and "HTTP 409: a swap is already running" in r.stderr and len(asked) == 1, r
