"""The worker reads the frontend's messages through one buffer (packrat.slots._ReadAhead):
TorchServe 0.12's parser asks the socket for every length, name and value on its own
(~35 recv calls a request with six HTTP headers). Through the buffer the same parser,
TorchServe's own (ts.protocol.otf_message_handler.retrieve_msg), gets the same messages
from one recv a message; a body larger than the buffer, two messages sent back to back
and a frontend that hangs up read as they do from the socket itself. Real sockets
(socketpair), TorchServe's real parser."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

otf = pytest.importorskip("ts.protocol.otf_message_handler")

from packrat.slots import READ_AHEAD, _ReadAhead  # noqa: E402


def _field(data: bytes) -> bytes:
    return struct.pack("!i", len(data)) + data


def _inference(requests: list[tuple[bytes, dict[bytes, bytes], bytes, bytes]]) -> bytes:
    """An inference message as TorchServe's frontend writes it (its Java codec's frame:
    per request its id, headers, then one parameter "body"; -1 ends each list)."""
    out = b"I"
    for req_id, headers, ctype, body in requests:
        out += _field(req_id)
        for name, value in headers.items():
            out += _field(name) + _field(value)
        out += struct.pack("!i", -1)
        out += _field(b"body") + _field(ctype) + _field(body)
        out += struct.pack("!i", -1)
    return out + struct.pack("!i", -1)


class _Counting:
    """A socket that counts its recv calls."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.calls = sock, 0

    def recv(self, n: int) -> bytes:
        self.calls += 1
        return self.sock.recv(n)


HEADERS = {b"Host": b"127.0.0.1:8080", b"User-Agent": b"lean/1", b"Accept": b"*/*",
           b"Authorization": b"Bearer 0123456789abcdef", b"Content-Type": b"text/plain",
           b"Content-Length": b"11"}


def _batch(n: int, body: bytes = b"great movie", ctype: bytes = b"text/plain") -> bytes:
    return _inference([(f"req-{i}".encode(), HEADERS, ctype, body) for i in range(n)])


def _read(messages: bytes, count: int, buffered: bool) -> tuple[list, int]:
    """`count` messages read with TorchServe's parser from a socket the messages were
    written to; and the recv calls it took."""
    a, b = socket.socketpair()
    sender = threading.Thread(target=b.sendall, args=(messages,))  # larger than the socket's buffer
    sender.start()
    try:
        if len(messages) < 8192:
            sender.join()  # all of it there before the first read
        sock = _Counting(a)
        conn = _ReadAhead(sock) if buffered else sock
        return [otf.retrieve_msg(conn) for _ in range(count)], sock.calls
    finally:
        sender.join(timeout=60)
        a.close()
        b.close()


def test_the_same_messages_from_one_recv() -> None:
    two = _batch(4) + _batch(3, b'{"text": "not bad at all"}', b"application/json")
    raw, raw_calls = _read(two, 2, buffered=False)
    got, calls = _read(two, 2, buffered=True)
    assert got == raw and len(got[0][1]) == 4 and got[1][1][2]["parameters"][0]["value"] == {"text": "not bad at all"}
    assert calls == 1 and raw_calls > 30 * 7  # both messages in one read; the socket itself: ~35 a request


def test_a_body_larger_than_the_buffer() -> None:
    jpeg = bytes(range(256)) * (3 * READ_AHEAD // 256)
    one = _batch(2, jpeg, b"image/jpeg")
    raw, _ = _read(one + _batch(1), 2, buffered=False)
    got, calls = _read(one + _batch(1), 2, buffered=True)
    assert got == raw and got[0][1][1]["parameters"][0]["value"] == jpeg
    assert calls < 20  # the body in a few large reads, not one per field


def test_a_frontend_that_hangs_up_ends_the_worker_as_before() -> None:
    a, b = socket.socketpair()
    b.sendall(_batch(1)[:-6])  # half a message, then the frontend goes
    b.close()
    with pytest.raises(SystemExit):  # TorchServe's parser exits on b"" from recv
        otf.retrieve_msg(_ReadAhead(a))
    a.close()
