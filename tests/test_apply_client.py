"""ManagementClient: every error answer becomes TorchServeError(method, url, status, body),
and an expired management key is refreshed and the call retried once.

Statuses a real TorchServe gives on demand (400, 404, 405, 409) are provoked
on a real one; those it gives only under faults (408, 500, 503, 507) come from
a loopback HTTP server answering in TorchServe's error format.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from packrat.apply.client import ManagementClient, read_key_file
from packrat.apply.server import start_torchserve
from packrat.errors import TorchServeError


@pytest.fixture(scope="module")
def short_token_server(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory):
    # Keys that expire after 3 s, so expiry and refresh happen inside the test.
    server = start_torchserve(
        tiny_store, tmp_path_factory.mktemp("client-ts"), extra_properties={"token_expiration_min": "0.05"}
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.torchserve
def test_real_torchserve_errors_are_translated(short_token_server) -> None:
    c = ManagementClient(short_token_server.management_url, short_token_server.key_file)
    base = short_token_server.management_url
    cases = [
        (lambda: c.describe("no-such-model"), "GET", f"{base}/models/no-such-model", 404),
        (lambda: c.register("", "x", 1), "POST", f"{base}/models", 404),  # "empty url"
        (lambda: c._request("POST", "/models", {"url": "noop", "runtime": "bogus"}), "POST", f"{base}/models", 400),
        (lambda: c._request("PATCH", "/models"), "PATCH", f"{base}/models", 405),
    ]
    c.register("noop", "noop", 1)
    cases.append((lambda: c.register("noop", "noop", 1), "POST", f"{base}/models", 409))  # same version twice
    for call, method, url, status in cases:
        with pytest.raises(TorchServeError) as info:
            call()
        err = info.value
        assert (err.method, err.url, err.status) == (method, url, status), err
        assert err.body and "<html" not in err.body.lower()  # TorchServe's message, not a page
    c.unregister("noop", "1.0")


@pytest.mark.torchserve
def test_expired_management_key_is_refreshed_and_retried(short_token_server) -> None:
    key_file = short_token_server.key_file
    old = read_key_file(key_file).management.key
    time.sleep(4)  # the 3-second key has expired
    # Reactive path: no early refresh, so the first answer is TorchServe's token error.
    reactive = ManagementClient(short_token_server.management_url, key_file, expiry_margin_s=-1e9)
    assert isinstance(reactive.list_models(), list)
    new = read_key_file(key_file).management.key
    assert new != old  # TorchServe issued a new key and rewrote its key file
    time.sleep(4)
    # Proactive path: the client sees the stated expiry and refreshes before calling.
    proactive = ManagementClient(short_token_server.management_url, key_file)
    assert isinstance(proactive.list_models(), list)
    assert read_key_file(key_file).management.key != new


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
    finally:
        httpd.server_close()
