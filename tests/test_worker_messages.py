"""The worker reads the frontend's messages through one buffer and parses them itself
(packrat.worker_messages): TorchServe 0.12's parser asks the socket for every length,
name and value on its own (~35 recv calls a request with six HTTP headers). Through the
buffer TorchServe's own parser (ts.protocol.otf_message_handler.retrieve_msg) gets the
same messages from one recv a message, and read_message gives what TorchServe's parser
gives (the same dicts, bytearrays and decoded bodies) for text, JSON, bodies that do not
decode, binary bodies larger than the buffer, messages sent back to back or split across
reads, and TS_DECODE_INPUT_REQUEST; a frontend that hangs up ends the worker as before.
Real sockets (socketpair), TorchServe's real parser."""

from __future__ import annotations

import logging
import socket
import struct
import threading

import pytest

otf = pytest.importorskip("ts.protocol.otf_message_handler")

from hypothesis import given, settings, strategies as st  # noqa: E402

from packrat.worker_messages import READ_AHEAD, REQUEST_LINE, FrontendReader, read_message  # noqa: E402


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


def _read(messages: bytes, count: int, buffered: bool, ours: bool = False, chunk: int | None = None) -> tuple[list, int]:
    """`count` messages read from a socket the messages were written to (in pieces of
    `chunk` bytes, when given, each its own send) with TorchServe's parser, through the
    buffer when `buffered`, or with read_message when `ours`; and the recv calls it took."""
    a, b = socket.socketpair()
    pieces = [messages] if chunk is None else [messages[i:i + chunk] for i in range(0, len(messages), chunk)]
    # a thread: more than the socket's buffer holds
    sender = threading.Thread(target=lambda: [b.sendall(p) for p in pieces])
    sender.start()
    try:
        if len(messages) < 8192 and chunk is None:
            sender.join()  # all of it there before the first read
        sock = _Counting(a)
        if ours:
            reader = FrontendReader(sock)
            return [read_message(reader, log_request_line=False) for _ in range(count)], sock.calls
        conn = FrontendReader(sock) if buffered else sock
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
        otf.retrieve_msg(FrontendReader(a))
    a.close()


def test_read_message_gives_what_torchserves_parser_gives() -> None:
    two = _batch(4) + _batch(3, b'{"text": "not bad at all"}', b"application/json")
    raw, _ = _read(two, 2, buffered=False)
    got, calls = _read(two, 2, buffered=True, ours=True)
    assert got == raw and calls == 1
    # the same types too: the handler and TorchServe's Service see no difference
    for ours, theirs in zip(got, raw):
        assert _types(ours) == _types(theirs)
    assert got[1][1][0]["parameters"][0]["value"] == {"text": "not bad at all"}


def _types(x):
    if isinstance(x, dict):
        return {k: _types(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_types(v) for v in x]
    return type(x).__name__


def test_bodies_that_do_not_decode_come_through_as_torchserve_passes_them() -> None:
    messages = (_batch(1, b'{"text": ', b"application/json") + _batch(1, b"\xff\xfe not utf-8", b"text/plain")
                + _batch(1, b"\x00\x01 raw", b"application/octet-stream"))
    raw, _ = _read(messages, 3, buffered=False)
    got, _ = _read(messages, 3, buffered=True, ours=True)
    assert got == raw and [_types(m) for m in got] == [_types(m) for m in raw]
    assert [m[1][0]["parameters"][0]["value"] for m in got] == [
        bytearray(b'{"text": '), bytearray(b"\xff\xfe not utf-8"), bytearray(b"\x00\x01 raw")]


def test_no_decoding_when_torchserve_is_told_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TS_DECODE_INPUT_REQUEST", "false")
    one = _batch(1, b'{"text": "x"}', b"application/json") + _batch(1, b"plain", b"text/plain")
    raw, _ = _read(one, 2, buffered=False)
    got, _ = _read(one, 2, buffered=True, ours=True)
    assert got == raw and got[0][1][0]["parameters"][0]["value"] == bytearray(b'{"text": "x"}')


def test_a_large_body_and_a_message_split_across_reads() -> None:
    jpeg = bytes(range(256)) * (3 * READ_AHEAD // 256)
    messages = _batch(2, jpeg, b"image/jpeg") + _batch(3)
    raw, _ = _read(messages, 2, buffered=False)
    for chunk in (None, 7, 1000):
        got, calls = _read(messages, 2, buffered=True, ours=True, chunk=chunk)
        assert got == raw, chunk
        if chunk is None:
            assert calls < 20  # the body in a few large reads, not one per field


def test_the_load_message_and_an_unknown_command() -> None:
    # name, path, batch size, handler, gpu id (-1: none), envelope, limitMaxImagePixels
    load = (b"L" + _field(b"m") + _field(b"/tmp/m") + struct.pack("!i", 4) + _field(b"h.py")
            + struct.pack("!i", -1) + _field(b"") + struct.pack("!?", True))
    raw, _ = _read(load + _batch(1), 2, buffered=False)
    got, _ = _read(load + _batch(1), 2, buffered=True, ours=True)
    assert got == raw and got[0][1]["modelName"] == b"m"
    a, b = socket.socketpair()
    b.sendall(b"X" + _batch(1)[1:])
    with pytest.raises(ValueError, match="Invalid command"):
        read_message(FrontendReader(a))
    a.close()
    b.close()


def test_a_frontend_that_hangs_up_mid_message_ends_read_message_too() -> None:
    for cut in (1, 3, 30, len(_batch(2)) - 2):
        a, b = socket.socketpair()
        b.sendall(_batch(2)[:cut])
        b.close()
        with pytest.raises(SystemExit):
            read_message(FrontendReader(a))
        a.close()


def test_the_request_line_is_logged_unless_asked_not_to(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        for log in (True, False):
            a, b = socket.socketpair()
            b.sendall(_batch(1))
            read_message(FrontendReader(a), log_request_line=log)
            a.close()
            b.close()
    assert [r.msg for r in caplog.records].count(REQUEST_LINE) == 1


_text = st.binary(max_size=40)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_text, st.dictionaries(_text, _text, max_size=4),
                          st.sampled_from([b"text/plain", b"application/json", b"image/jpeg", b""]),
                          st.one_of(_text, st.text(max_size=40).map(str.encode))),
                min_size=1, max_size=5),
       st.sampled_from([None, 1, 5, 64]))
def test_any_batch_reads_as_torchserve_reads_it(requests: list, chunk: int | None) -> None:
    message = _inference(requests)
    raw, _ = _read(message, 1, buffered=False)
    got, _ = _read(message, 1, buffered=True, ours=True, chunk=chunk)
    assert got == raw and [_types(m) for m in got] == [_types(m) for m in raw]


def test_the_bench_times_each_reader_on_each_message(tmp_path) -> None:
    import json

    from packrat.bench.message_parse import MESSAGES, run

    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.INFO)  # as a caller that logs at info has it
    try:
        md = run(tmp_path / "wm", "python scripts/bench_worker_messages.py", rounds=2, calls=5)
        assert root.level == logging.INFO  # the bench quiets TorchServe's info lines only while it times
    finally:
        root.setLevel(before)
    records = [json.loads(line) for line in md.with_suffix(".jsonl").read_text().splitlines()]
    rows = [r for r in records if r.get("kind") != "run"]
    assert {(r["message"], r["reader"]) for r in rows} == {
        (m, k) for m in MESSAGES for k in ("torchserve", "torchserve-buffered", "read_message")}
    assert len(rows) == 2 * 3 * len(MESSAGES) and all(r["us"] > 0 for r in rows)
    text = md.read_text()
    assert "figures: a batch of 4 short texts read in" in text
    assert sum(line.startswith(f"| {m} |") for m in MESSAGES for line in text.splitlines()) == len(MESSAGES)
