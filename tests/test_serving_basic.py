"""End to end through a real TorchServe: archives register by directory name,
token auth is enforced, the handler answers, stop() leaves no process (and no
private slot directory) behind."""

from __future__ import annotations

import os

import pytest
import requests

from packrat.server import start_torchserve
from serving_support import ensure_registered, http_stand_in, process_alive, start_server, stop_in_background

pytestmark = pytest.mark.torchserve


def test_noop_and_tiny_bert_served_with_token(torchserve) -> None:
    ensure_registered(torchserve, "noop", "tiny-bert")
    url = torchserve.inference_url
    headers = torchserve.inference_headers()

    echo = requests.post(f"{url}/predictions/noop", data=b"hello packrat", headers=headers, timeout=60)
    assert echo.status_code == 200
    assert echo.content == b"hello packrat"

    r = requests.post(f"{url}/predictions/tiny-bert", data="a short review".encode(),
                      headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body["scores"]) == {"LABEL_0", "LABEL_1"}
    assert body["label"] == max(body["scores"], key=body["scores"].get)
    assert abs(sum(body["scores"].values()) - 1.0) < 1e-5


def test_request_without_or_with_wrong_token_is_refused(torchserve) -> None:
    ensure_registered(torchserve, "noop")
    url = f"{torchserve.inference_url}/predictions/noop"
    assert requests.post(url, data=b"x", timeout=30).status_code in (400, 401)
    bad = {"Authorization": "Bearer not-the-key"}
    refused = requests.post(url, data=b"x", headers=bad, timeout=30)
    assert refused.status_code in (400, 401)
    assert "Token Authorization failed" in refused.text
    # The management key is not an inference key either.
    assert requests.post(url, data=b"x", headers=torchserve.management_headers(),
                         timeout=30).status_code in (400, 401)
    # Management API refuses without its key as well.
    assert requests.get(f"{torchserve.management_url}/models", timeout=30).status_code in (400, 401)


def test_stop_leaves_no_process_and_two_servers_coexist(tiny_store, tmp_path) -> None:
    a = start_server(tiny_store, tmp_path / "a")
    try:
        b = start_server(tiny_store, tmp_path / "b")
        try:
            assert a.ports != b.ports
            for s in (a, b):
                s.register("noop")
                r = requests.post(f"{s.inference_url}/predictions/noop", data=b"x",
                                  headers=s.inference_headers(), timeout=60)
                assert r.status_code == 200
                # Each server's worker reports into that server's own slot dir.
                pid = s.management_client().describe("noop")["workers"][0]["pid"]
                assert (s.slot_dir / "workers" / f"{pid}.json").exists()
                assert s.slot_dir.is_relative_to(s.workdir)
            worker_pid = a.management_client().describe("noop")["workers"][0]["pid"]
        finally:
            b.stop()
        # b's stop did not touch a, and took b's slot dir with it
        assert requests.get(f"{a.inference_url}/ping", headers=a.inference_headers(),
                            timeout=10).status_code == 200
        assert not b.slot_dir.exists() and a.slot_dir.exists()
    finally:
        a.stop()
    for pid in (a.pid, worker_pid):
        assert not process_alive(pid), f"pid {pid} survived stop()"
    assert not a.slot_dir.exists()


def test_start_failure_reports_log_tail(tiny_store, tmp_path) -> None:
    from packrat.errors import ServerError

    bad = tmp_path / "bad.properties"
    bad.write_text("inference_address=http://127.0.0.1:notaport\n")
    with pytest.raises(ServerError) as info:
        start_torchserve(tiny_store, tmp_path / "w", config_template=bad, timeout_s=60,
                         extra_properties={"inference_address": "http://127.0.0.1:notaport"})
    assert "torchserve.out" in str(info.value) or "ts_log" in str(info.value)
    assert not os.path.exists(tmp_path / "w" / "server.json")
    # Again in the same workdir, whose logs hold an earlier run's lines: the tail is this start's
    (tmp_path / "w" / "torchserve.out").write_text("an earlier run's line\n" * 100, encoding="utf-8")
    (tmp_path / "w" / "logs").mkdir(exist_ok=True)
    (tmp_path / "w" / "logs" / "model_log.log").write_text("an earlier worker's line\n" * 100, encoding="utf-8")
    with pytest.raises(ServerError) as again:
        start_torchserve(tiny_store, tmp_path / "w", config_template=bad, timeout_s=60,
                         extra_properties={"inference_address": "http://127.0.0.1:notaport"})
    text = str(again.value)
    assert "of this start" in text and "earlier" not in text, text


def test_start_on_a_taken_port_says_which_and_how_to_go_on(tiny_store, tmp_path) -> None:
    """Something already listens on the inference port (another TorchServe, `make run` twice
    from two checkouts): refused at once, naming the port and the way to free ones, before
    a frontend starts and fails among a hundred log lines; the listener is left alone."""
    import socket
    import time

    from packrat.errors import ServerError
    from packrat.server import Ports, free_ports

    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        ports = Ports(port, *free_ports(4))
        began = time.monotonic()
        with pytest.raises(ServerError) as info:
            start_torchserve(tiny_store, tmp_path / "w", ports=ports, timeout_s=60)
        assert time.monotonic() - began < 5  # no JVM was started
        text = str(info.value)
        assert f"port {port} (inference_address) already in use" in text and "--free-ports" in text, text
        assert not (tmp_path / "w").exists()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # still listening


def test_worker_claims_its_slot_before_serving(torchserve, tiny_store) -> None:
    """initialize() pins the worker to its slot's cores (packrat.slots in model_config.yaml)."""
    import shutil
    import uuid

    from packrat.archive import ArchiveOptions, build_named

    core = max(os.sched_getaffinity(0))
    tag = uuid.uuid4().hex[:8]
    slots = {"plan_id": f"test-{tag}", "slots": [{"cores": [core], "threads": 1}]}
    # A name of its own in the shared store, removed again: no other test's archive is rebuilt.
    name = f"noop-pinned-{tag}"
    build_named("noop", tiny_store, name, ArchiveOptions(extra=slots))
    try:
        pid = torchserve.register(name)[0]["pid"]
        try:
            assert os.sched_getaffinity(pid) == {core}
            r = requests.post(f"{torchserve.inference_url}/predictions/{name}", data=b"x",
                              headers=torchserve.inference_headers(), timeout=60)
            assert r.status_code == 200
        finally:
            torchserve.management_client().unregister(name, "1.0")
    finally:
        shutil.rmtree(tiny_store / name, ignore_errors=True)


def test_the_start_pings_torchserve_directly_not_through_a_proxy(tmp_path, monkeypatch) -> None:
    """The start's /ping carries the inference key: an HTTP proxy named in the environment got
    it (and a proxy that cannot reach this loopback left the start waiting until its timeout)."""
    (tmp_path / "store").mkdir()
    with http_stand_in(lambda method, path: (502, "text/plain", b"a proxy")) as (proxy, proxied):
        for name in ("HTTP_PROXY", "http_proxy"):
            monkeypatch.setenv(name, proxy)
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        server = start_server(tmp_path / "store", tmp_path / "ts", timeout_s=60)
        stop_in_background(server)
    assert proxied == []
