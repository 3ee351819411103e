"""The lean closed loop (packrat.bench.loadgen.lean) against real loopback servers: every request
answered or counted as an error, the server sees what was sent, failures are results.

No speed thresholds; its CPU per request against urllib3 is in the efficiency results pages."""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Iterator

import pytest

from packrat.bench.loadgen import Target, lean_closed_loop, window_closed_loop
from packrat.bench.loadgen.lean import _chunked_end, _parse_head, request_bytes
from packrat.bench.localserver import LocalServer, local_server
from packrat.errors import ConfigError
from packrat.server import free_ports


@pytest.fixture()
def server() -> Iterator[LocalServer]:
    with local_server() as srv:
        yield srv


def _seen(srv: LocalServer) -> int:
    seen = next(srv.counter) - 1
    srv.counter = itertools.count(seen + 1)
    return seen


def test_every_request_answered_and_seen_once(server: LocalServer) -> None:
    res = lean_closed_loop(Target(f"http://127.0.0.1:{server.port}/p", b"x" * 5000, token="k1"), 4, 1.0)
    assert res.errors == 0 and res.ok > 4
    # One request outstanding per client, none sent after the window: the server saw
    # exactly the requests answered.
    assert _seen(server) == res.ok
    assert set(server.auth_seen) == {"Bearer k1"}
    assert res.p50_ms is not None and res.p50_ms > 0
    assert res.generator_cpu_ms_per_request > 0


def test_http_errors_are_counted_not_resent(server: LocalServer) -> None:
    res = lean_closed_loop(Target(f"http://127.0.0.1:{server.port}/p?fail_every=3", b"{}"), 2, 1.0)
    assert res.error_kinds.get("http_500", 0) == _seen(server) // 3
    assert res.ok + res.errors == _seen(server)
    assert set(res.error_kinds) == {"http_500"}


def test_timeout_and_refused_are_results() -> None:
    port = free_ports(1)[0]
    res = lean_closed_loop(Target(f"http://127.0.0.1:{port}/p", b"", timeout_s=1.0), 2, 0.3)
    assert res.ok == 0 and res.errors >= 2 and set(res.error_kinds) == {"connection:refused"}
    with local_server() as slow:
        res = lean_closed_loop(Target(f"http://127.0.0.1:{slow.port}/p?sleep_ms=1500", b"", timeout_s=0.3), 1, 0.1)
    assert res.ok == 0 and res.error_kinds == {"timeout": 1}


def _chunked_server(answer: bytes) -> tuple[int, threading.Thread]:
    """Serves `answer` (raw bytes) to every request on one keep-alive connection."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn, lsock:
            buf = b""
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while b"\r\n\r\n" in buf:  # bodies are empty here
                    _, buf = buf.split(b"\r\n\r\n", 1)
                    conn.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lsock.getsockname()[1], t


def test_chunked_answers_and_batch_header_are_read() -> None:
    answer = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nx-packrat-batch-size: 3\r\n\r\n"
              b"4\r\nabcd\r\n3;ext=1\r\nefg\r\n0\r\n\r\n")
    port, t = _chunked_server(answer)
    res = lean_closed_loop(Target(f"http://127.0.0.1:{port}/p", b""), 1, 0.3)
    assert res.errors == 0 and res.ok >= 1 and res.mean_batch_size == 3


def test_parsers() -> None:
    host, port, raw = request_bytes(Target("http://127.0.0.1:8080/a?b=1", b"xyz", "text/plain", "t"))
    head, body = raw.split(b"\r\n\r\n", 1)
    assert (host, port, body) == ("127.0.0.1", 8080, b"xyz")
    assert head.startswith(b"POST /a?b=1 HTTP/1.1\r\n") and b"Content-Length: 3" in head
    assert b"Authorization: Bearer t" in head and b"Content-Type: text/plain" in head
    buf = bytearray(b"HTTP/1.1 503 Busy\r\nContent-Length: 2\r\n\r\nno")
    a = _parse_head(buf, buf.find(b"\r\n\r\n"))
    assert (a.status, a.length, a.head_len) == (503, 2, len(buf) - 2)
    with pytest.raises(ConnectionError):  # no length: the keep-alive connection could not go on
        _parse_head(bytearray(b"HTTP/1.1 200 OK\r\n\r\n"), 15)
    part = bytearray(b"5\r\nhello\r\n")
    assert _chunked_end(part, 0) is None
    part += b"0\r\n\r\n"
    assert _chunked_end(part, 0) == len(part)


def test_window_client_names(server: LocalServer) -> None:
    t = Target(f"http://127.0.0.1:{server.port}/p", b"")
    assert window_closed_loop(t, 1, 0.2, "urllib3").ok >= 1
    with pytest.raises(ConfigError):
        window_closed_loop(t, 1, 0.2, "ab")
    with pytest.raises(ConfigError):  # loopback only
        lean_closed_loop(Target("http://10.0.0.1:80/p"), 1, 0.1)
