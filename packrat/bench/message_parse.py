"""What reading one frontend message costs a worker (scripts/bench_worker_messages.py): three
ways side by side on the same messages, interleaved over rounds, in one process.

- `torchserve`: TorchServe 0.12's parser on the socket itself (a `recv` for every field);
- `torchserve-buffered`: the same parser through packrat.worker_messages.FrontendReader
  (one `recv` a message: what the worker ran before read_message);
- `read_message`: packrat.worker_messages.read_message, what the worker runs now.

Each call is one message written to a socketpair and read back, the time taken from the
write's end to the parsed message (time.perf_counter). Messages: batches of short texts
with the six HTTP headers a client sends, and one request with a 100 KB body.
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HEADERS = ((b"Host", b"127.0.0.1:8080"), (b"User-Agent", b"packrat-loadgen/1"), (b"Accept", b"*/*"),
           (b"Authorization", b"Bearer 0123456789abcdef0123456789abcdef"), (b"Content-Type", b"text/plain"),
           (b"Content-Length", b"30"))
TEXT = b"a short text of thirty bytes!!"
IMAGE = bytes(range(256)) * 400  # 100 KB


def _field(data: bytes) -> bytes:
    return struct.pack("!i", len(data)) + data


def inference_message(count: int, body: bytes, content_type: bytes) -> bytes:
    """An inference message as TorchServe's frontend writes it (its Java codec)."""
    end = struct.pack("!i", -1)
    out = b"I"
    for i in range(count):
        out += _field(f"{i:08d}-0000-4000-8000-000000000000".encode())
        out += b"".join(_field(k) + _field(v) for k, v in HEADERS) + end
        out += _field(b"body") + _field(content_type) + _field(body) + end
    return out + end


MESSAGES = {"1 text": inference_message(1, TEXT, b"text/plain"),
            "4 texts": inference_message(4, TEXT, b"text/plain"),
            "8 texts": inference_message(8, TEXT, b"text/plain"),
            "1 image (100 KB)": inference_message(1, IMAGE, b"image/jpeg")}


def _readers() -> dict[str, Callable[[Any], Callable[[], Any]]]:
    from ts.protocol.otf_message_handler import retrieve_msg

    from packrat.worker_messages import FrontendReader, read_message

    def plain(sock: socket.socket) -> Callable[[], Any]:
        return lambda: retrieve_msg(sock)

    def buffered(sock: socket.socket) -> Callable[[], Any]:
        reader = FrontendReader(sock)
        return lambda: retrieve_msg(reader)

    def ours(sock: socket.socket) -> Callable[[], Any]:
        reader = FrontendReader(sock)
        return lambda: read_message(reader, log_request_line=False)

    return {"torchserve": plain, "torchserve-buffered": buffered, "read_message": ours}


def _time(read: Callable[[], Any], sender: socket.socket, message: bytes, calls: int) -> float:
    """The median microseconds of `calls` reads of `message`."""
    times = []
    for _ in range(calls):
        sender.sendall(message)
        t0 = time.perf_counter()
        read()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(rounds: int = 5, calls: int = 1000, warm: int = 200) -> list[dict[str, Any]]:
    """A row per (message, reader, round): the median microseconds a message."""
    import logging

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)  # TorchServe's parser logs a line a message at info
    try:
        return _measure(rounds, calls, warm)
    finally:
        root.setLevel(level)  # the caller's logging as it was


def _measure(rounds: int, calls: int, warm: int) -> list[dict[str, Any]]:
    rows = []
    readers = _readers()
    for message_name, message in MESSAGES.items():
        for r in range(rounds):
            for reader_name, make in readers.items():
                a, b = socket.socketpair()
                b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
                try:
                    read = make(b)
                    _time(read, a, message, warm)
                    rows.append({"message": message_name, "reader": reader_name, "round": r,
                                 "bytes": len(message), "us": round(_time(read, a, message, calls), 2)})
                finally:
                    a.close()
                    b.close()
    return rows


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def med(message: str, reader: str) -> float:
        return statistics.median(r["us"] for r in rows if r["message"] == message and r["reader"] == reader)

    figures = ("a batch of 4 short texts read in " + ", ".join(
        f"{med('4 texts', k):.1f} us ({label})" for k, label in
        (("read_message", "read_message"), ("torchserve-buffered", "TorchServe's parser through one buffer"),
         ("torchserve", "TorchServe's parser on the socket"))))
    lines = ["---", f"date: {meta['date']}", f"machine: {meta['machine']}", f"command: {meta['command']}",
             f"figures: {figures}", "---", "", "# What reading one frontend message costs a worker", "",
             f"Medians of {meta['calls']} reads a round, {meta['rounds']} rounds interleaved (readers in turn "
             "within each round); the spread is the rounds' lowest and highest median. One process, "
             "one core's time (packrat/bench/message_parse.py says what each reader is).", "",
             "| message | bytes | TorchServe's parser, us | through the buffer, us | read_message, us | "
             "read_message / TorchServe's | read_message / buffered |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in MESSAGES:
        got = {reader: [r["us"] for r in rows if r["message"] == name and r["reader"] == reader]
               for reader in ("torchserve", "torchserve-buffered", "read_message")}
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in got.values()]
        size = next(r["bytes"] for r in rows if r["message"] == name)
        ours = med(name, "read_message")
        lines.append(f"| {name} | {size} | {' | '.join(cells)} | {ours / med(name, 'torchserve'):.3f} | "
                     f"{ours / med(name, 'torchserve-buffered'):.3f} |")
    return "\n".join(lines) + "\n"


def run(out: Path, command: str, rounds: int, calls: int) -> Path:
    from packrat.bench.machine import describe_machine

    started = time.time()
    rows = measure(rounds, calls)
    machine = describe_machine()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)), "command": command,
            "machine": f"{machine.label}, {machine.cores} cores", "rounds": rounds, "calls": calls}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps({"kind": "run", **meta}) + "\n")
    out.with_suffix(".md").write_text(render(rows, meta))
    return out.with_suffix(".md")


def rerender(path: Path) -> Path:
    """The .md again from a run's .jsonl (a render change, or a machine line edited there)."""
    records = [json.loads(line) for line in path.with_suffix(".jsonl").read_text().splitlines()]
    meta = next(r for r in records if r.get("kind") == "run")
    path.with_suffix(".md").write_text(render([r for r in records if r.get("kind") != "run"], meta))
    return path.with_suffix(".md")
