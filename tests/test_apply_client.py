"""ManagementClient: every error answer becomes TorchServeError(method, url, status, body),
and a rejected or expired management key is refreshed through TorchServe's
token API (with the API key) and the call retried once.

Statuses a real TorchServe gives on demand (400, 404, 405, 409) are provoked
on a real one; those it gives only under faults (408, 500, 503, 507) come from
a loopback HTTP server answering in TorchServe's error format.

The real TorchServe is this module's own: these tests rotate its management
key and rewrite its key file, which no other module's server should see.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from packrat.apply.client import ManagementClient
from packrat.apply.keys import read_keys
from packrat.errors import TorchServeError
from serving_support import start_server, stop_in_background


@pytest.fixture(scope="module")
def torchserve(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory):
    """This module's own server (shadows the session one)."""
    server = start_server(tiny_store, tmp_path_factory.mktemp("client-ts"))
    try:
        yield server
    finally:
        stop_in_background(server)


@pytest.mark.torchserve
def test_real_torchserve_errors_are_translated(torchserve) -> None:
    c = ManagementClient(torchserve.management_url, torchserve.key_file)
    base = torchserve.management_url
    cases = [
        (lambda: c.describe("no-such-model"), "GET", f"{base}/models/no-such-model", 404),
        (lambda: c.register("", "x", 1), "POST", f"{base}/models", 404),  # "empty url"
        (lambda: c._request("POST", "/models", {"url": "noop", "runtime": "bogus"}), "POST", f"{base}/models", 400),
        (lambda: c._request("PATCH", "/models"), "PATCH", f"{base}/models", 405),
    ]
    c.register("noop", "noop", 1)
    try:
        cases.append((lambda: c.register("noop", "noop", 1), "POST", f"{base}/models", 409))  # same version twice
        for call, method, url, status in cases:
            with pytest.raises(TorchServeError) as info:
                call()
            err = info.value
            assert (err.method, err.url, err.status) == (method, url, status), err
            assert err.body and "<html" not in err.body.lower()  # TorchServe's message, not a page
    finally:
        c.unregister("noop", "1.0")


def _rewrite(key_file: Path, data: dict) -> None:
    key_file.write_text(json.dumps(data))
    # A different mtime, so the client notices even within the file system's time resolution.
    st = key_file.stat()
    os.utime(key_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


@pytest.mark.torchserve
def test_rejected_key_is_refreshed_and_the_call_retried(torchserve) -> None:
    """TorchServe 0.12 answers a wrong and an expired key alike (HTTP 400, "Token
    Authorization failed"). Here the key the client holds was rotated away by
    someone else and the file still shows it (a stale file)."""
    key_file = torchserve.key_file
    stale = json.loads(key_file.read_text())
    client = ManagementClient(torchserve.management_url, key_file)
    assert isinstance(client.list_models(), list)
    other = ManagementClient(torchserve.management_url, key_file)
    other.refresh_management_key()  # TorchServe now has another management key
    rotated = read_keys(key_file).management.key
    assert rotated != stale["management"]["key"]
    _rewrite(key_file, stale)  # ... but the file shows the old one again
    assert isinstance(client.list_models(), list)  # 400 -> refresh via the API key -> retry -> 200
    fresh = read_keys(key_file).management.key
    assert fresh not in (stale["management"]["key"], rotated)


@pytest.mark.torchserve
def test_key_past_its_expiry_is_refreshed_before_the_call(torchserve) -> None:
    key_file = torchserve.key_file
    data = json.loads(key_file.read_text())
    before = data["management"]["key"]
    data["management"]["expiration time"] = "2020-01-01T00:00:00Z"  # as TorchServe writes it
    _rewrite(key_file, data)
    client = ManagementClient(torchserve.management_url, key_file)
    assert isinstance(client.list_models(), list)
    after = read_keys(key_file)
    assert after.management.key != before
    assert after.management.expires is not None and after.management.expires.timestamp() > time.time()


class _Faults(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        status = int(self.path.strip("/").split("/")[-1])
        body = json.dumps({"code": status, "type": "X", "message": f"fault {status}"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


def test_fault_statuses_are_translated(tmp_path: Path) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Faults)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        c = ManagementClient(base, None)
        for status in (400, 401, 403, 404, 405, 408, 409, 500, 503, 507):
            with pytest.raises(TorchServeError) as info:
                c._request("GET", f"/models/{status}")
            assert info.value.status == status
            assert info.value.body == f"fault {status}"
            assert info.value.url == f"{base}/models/{status}"
        # Nobody listening: status 0, after the transport retries.
        httpd.shutdown()
        httpd.server_close()
        with pytest.raises(TorchServeError) as info:
            c.list_models()
        assert info.value.status == 0 and "unreachable" in info.value.body
        # One line with the reason, not requests' nested repr (seen in `packrat status` once
        # TorchServe had died: "HTTP 0: unreachable: HTTPConnectionPool(host=...) Max retries ...").
        assert str(info.value).endswith(": TorchServe does not answer (Connection refused)"), str(info.value)
    finally:
        httpd.server_close()


def test_keys_read_while_torchserve_rewrites_the_file_wait_for_it(tmp_path: Path) -> None:
    """TorchServe truncates key_file.json, then writes it (seen in CI: a client re-reading keys
    after a frontend restart got an empty file). A read in that window waits for the whole file;
    a file that stays broken is still an error, after the grace; a missing file, or JSON without
    a key, is one at once."""
    key_file = tmp_path / "key_file.json"
    key_file.write_text("")
    whole = {"management": {"key": "m1", "expiration time": "2099-01-01T00:00:00Z"},
             "inference": {"key": "i1", "expiration time": "2099-01-01T00:00:00Z"}, "API": {"key": "a1"}}
    text = json.dumps(whole)
    writer = threading.Timer(0.2, lambda: key_file.write_text(text))
    key_file.write_text(text[: len(text) // 2])  # half-written first
    writer.start()
    try:
        assert read_keys(key_file).inference.key == "i1"
    finally:
        writer.cancel()
    key_file.write_text("{")
    t0 = time.monotonic()
    with pytest.raises(TorchServeError, match="cannot read TorchServe keys"):
        read_keys(key_file, grace_s=0.3)
    assert time.monotonic() - t0 >= 0.3
    with pytest.raises(TorchServeError, match="No such file"):
        read_keys(tmp_path / "absent.json")  # a missing file is not waited for
    key_file.write_text(json.dumps({"management": whole["management"]}))
    t0 = time.monotonic()
    with pytest.raises(TorchServeError, match="no 'inference' key"):
        read_keys(key_file)  # whole JSON without a key: not a rewrite, not waited for
    assert time.monotonic() - t0 < 1.0


@pytest.mark.torchserve
def test_printed_keys_work_after_their_expiry(torchserve) -> None:
    """`make run` says "Keys expire after 60 min: print fresh ones with packrat torchserve
    keys"; TorchServe 0.12 does not renew them, so the command printed the expired key."""
    import subprocess
    import sys

    import requests

    key_file = torchserve.key_file
    data = json.loads(key_file.read_text())
    old = data["inference"]["key"]
    data["inference"]["expiration time"] = "2020-01-01T00:00:00Z"  # as TorchServe writes it
    _rewrite(key_file, data)
    cli = [sys.executable, "-m", "packrat.cli", "torchserve", "keys", "--workdir", str(torchserve.workdir)]
    out = subprocess.run(cli + ["inference"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    new = out.stdout.strip()
    assert new != old and new == read_keys(key_file).inference.key
    assert not read_keys(key_file).inference.expired()

    def inference_with(key: str) -> int:
        return requests.post(f"{torchserve.inference_url}/predictions/no-such-model", data=b"x",
                             headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

    assert inference_with(new) == 404  # let in: no such model
    assert inference_with(old) == 400  # TorchServe's refusal of a key it no longer holds
    # A key that has not expired is printed as it is, and nothing is renewed.
    again = subprocess.run(cli + ["inference"], capture_output=True, text=True, timeout=60)
    assert again.stdout.strip() == new
    wrong = subprocess.run(cli + ["secret"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "'secret' is not one of: inference, management, api" in wrong.stderr
