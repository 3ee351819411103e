"""A closed loop for a timed window at the least client CPU: one thread, raw keep-alive sockets.

Why a second closed loop: on 2 cores the generator shares the CPU with the
server it measures, so every millisecond it spends per request is taken from
the workers. urllib3 (connection.py) costs ~0.25-0.37 ms of CPU a request
through TorchServe (docs/benchmarks/efficiency-epyc.md), one thread per client
waking for every answer. An external client such as ApacheBench (`ab -k`, what
issue 35 measured with) costs a fraction of that. Here one thread multiplexes
every client's socket with `selectors`: the request's bytes are built once,
an answer is parsed only as far as its status line and the headers it needs
(Content-Length or chunked, the batch-size header), so a request costs a few
tens of microseconds of Python.

Semantics match counted.closed_loop(..., warmup=0, max_duration_s=seconds):
`clients` requests outstanding until the window ends; none is sent after it;
those in flight then are waited for (up to the timeout) and counted. Failures
are results, never re-sent: a refused or reset connection, a timeout, an HTTP
status outside 2xx. Only loopback targets, as every load here.
"""

from __future__ import annotations

import selectors
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from packrat.bench.loadgen.connection import check_loopback
from packrat.bench.loadgen.counted import BATCH_SIZE_HEADER, LoadResult, RequestRecord, Target, summarise
from packrat.errors import ConfigError

_HEAD_END = b"\r\n\r\n"
_BATCH = BATCH_SIZE_HEADER.encode()


def request_bytes(target: Target) -> tuple[str, int, bytes]:
    """(host, port, the whole POST as bytes) for `target`."""
    check_loopback(target.url)
    parts = urlsplit(target.url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(target.body)}"]
    lines += [f"{k}: {v}" for k, v in target.headers().items()]
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + target.body


@dataclass
class _Answer:
    """What is known of the answer being read on one connection."""

    status: int = 0
    head_len: int = -1  # bytes up to and including the blank line; -1: head not complete
    length: int | None = None  # Content-Length; None with chunked
    chunked: bool = False
    batch_size: int | None = None


def _parse_head(buf: bytearray, end: int) -> _Answer:
    head = bytes(buf[:end]).split(b"\r\n")
    try:
        status = int(head[0].split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise ConnectionError("malformed status line") from None
    ans = _Answer(status=status, head_len=end + 4)
    for line in head[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            ans.length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            ans.chunked = True
        elif name == _BATCH:
            try:
                ans.batch_size = int(value)
            except ValueError:
                pass
    if ans.length is None and not ans.chunked:
        raise ConnectionError("answer without a length: the connection cannot be kept")
    return ans


def _chunked_end(buf: bytearray, start: int) -> int | None:
    """Where a chunked body starting at `start` ends (after its last CRLF); None: not all read."""
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        if size == 0:
            end = buf.find(_HEAD_END, eol)  # no trailers are expected: the final CRLF
            return None if end < 0 else end + 4
        pos = eol + 2 + size + 2
        if pos > len(buf):
            return None


@dataclass
class _Conn:
    sock: socket.socket | None = None
    buf: bytearray = field(default_factory=bytearray)
    answer: _Answer = field(default_factory=_Answer)
    sent_at: float = 0.0


class LeanLoop:
    """`clients` connections, one request outstanding on each, all driven by the calling thread."""

    def __init__(self, target: Target, clients: int) -> None:
        if clients < 1:
            raise ConfigError("closed loop needs clients >= 1")
        self.host, self.port, self.request = request_bytes(target)
        self.timeout_s = target.timeout_s
        self.clients = clients
        self.sel = selectors.DefaultSelector()
        self.conns = [_Conn() for _ in range(clients)]
        self.records: list[RequestRecord] = []

    def _send(self, c: _Conn) -> None:
        c.buf.clear()
        c.answer = _Answer()
        c.sent_at = time.perf_counter()
        try:
            if c.sock is None:
                c.sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
                c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.sel.register(c.sock, selectors.EVENT_READ, c)
            c.sock.sendall(self.request)
        except ConnectionRefusedError:
            self._fail(c, "connection:refused")
        except OSError as exc:
            self._fail(c, f"connection:{type(exc).__name__}")

    def _fail(self, c: _Conn, kind: str) -> None:
        self.records.append(RequestRecord(c.sent_at, (time.perf_counter() - c.sent_at) * 1000.0, 0, kind))
        self._drop(c)

    def _drop(self, c: _Conn) -> None:
        if c.sock is not None:
            try:
                self.sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
            c.sock.close()
            c.sock = None
        c.sent_at = 0.0

    def _read(self, c: _Conn) -> bool:
        """Read what arrived; True when the answer is complete (and recorded)."""
        assert c.sock is not None
        try:
            data = c.sock.recv(262144)
        except OSError as exc:
            self._fail(c, f"connection:{type(exc).__name__}")
            return True
        if not data:
            self._fail(c, "connection:closed")
            return True
        c.buf += data
        a = c.answer
        try:
            if a.head_len < 0:
                end = c.buf.find(_HEAD_END)
                if end < 0:
                    return False
                a = c.answer = _parse_head(c.buf, end)
            done = (a.head_len + a.length if a.length is not None else _chunked_end(c.buf, a.head_len))
        except (ConnectionError, ValueError) as exc:
            self._fail(c, f"connection:{type(exc).__name__}")
            return True
        if done is None or len(c.buf) < done:
            return False
        if len(c.buf) > done:  # bytes past the answer on a one-request connection: not HTTP/1.1 as sent
            self._fail(c, "connection:extra-bytes")
            return True
        ok = 200 <= a.status < 300
        self.records.append(RequestRecord(c.sent_at, (time.perf_counter() - c.sent_at) * 1000.0, a.status,
                                          None if ok else f"http_{a.status}", a.batch_size if ok else None))
        c.sent_at = 0.0
        return True

    def run(self, seconds: float) -> LoadResult:
        """Send for `seconds`, then wait for the answers in flight; the summary of every request."""
        cpu0 = time.process_time()
        deadline = time.perf_counter() + seconds
        for c in self.conns:
            self._send(c)
        try:
            while True:
                now = time.perf_counter()
                busy = [c for c in self.conns if c.sent_at]
                if not busy and now >= deadline:
                    break
                for c in busy:  # a request past its timeout: a result, and a fresh connection
                    if now - c.sent_at > self.timeout_s:
                        self._fail(c, "timeout")
                for key, _ in self.sel.select(timeout=0.05):
                    c = key.data
                    if c.sent_at and self._read(c) and time.perf_counter() < deadline:
                        self._send(c)
                if now < deadline:
                    for c in self.conns:  # a failed request's client sends again
                        if not c.sent_at:
                            self._send(c)
        finally:
            for c in self.conns:
                self._drop(c)
            self.sel.close()
        return summarise(self.records, mode="closed", clients=self.clients, rate_rps=None,
                         requested=len(self.records), cpu_s=time.process_time() - cpu0)


def lean_closed_loop(target: Target, clients: int, seconds: float) -> LoadResult:
    """`clients` closed-loop clients for `seconds` through one thread (module doc)."""
    return LeanLoop(target, clients).run(seconds)


# The closed-loop clients a timed window can be sent with: "lean" (above) or "urllib3"
# (counted.closed_loop: a thread per client, what every other load here uses).
CLIENTS = ("lean", "urllib3")


def window_closed_loop(target: Target, clients: int, seconds: float, client: str = "lean") -> LoadResult:
    """`clients` closed-loop clients for a `seconds` window through the named client."""
    if client == "lean":
        return lean_closed_loop(target, clients, seconds)
    if client == "urllib3":
        from packrat.bench.loadgen.counted import closed_loop

        return closed_loop(target, clients, 10**9, warmup=0, max_duration_s=seconds)
    raise ConfigError(f"unknown client {client!r}: one of {', '.join(CLIENTS)}")
