"""The frontend's messages as a TorchServe 0.12 worker reads them, in one pass over one buffer.

TorchServe's own parser (ts/protocol/otf_message_handler.py) asks the socket for every
length, name and value of a message on its own: ~35 `recv` calls a request with six HTTP
headers. FrontendReader reads a message with one `recv` (up to READ_AHEAD bytes) and
read_message parses an inference message from that buffer, giving TorchServe's worker loop
what its own parser gives (the same dicts, bytearrays and decoded values;
tests/test_worker_messages.py holds them side by side). A batch of four short texts: 51 us,
against 122 us for TorchServe's parser through the same buffer and 256 us on the socket
(2-core AMD EPYC Zen 3, docs/benchmarks/worker-messages-avx2-epyc.md). Any other message
(the model's load) goes through TorchServe's own parser over the same buffer.

Stdlib only (TorchServe's parser is imported for a load message): it runs inside every worker.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
import time
from typing import Any

# What one read from the frontend's socket asks for (bytes): a batch's message of short
# texts is ~1-3 KB, so it arrives in one read.
READ_AHEAD = 65536
_INT = struct.Struct("!i")
# TorchServe 0.12's worker logs this at info for every inference message it reads.
REQUEST_LINE = "Backend received inference at: %d"


class FrontendReader:
    """The worker's socket to the frontend, read through one buffer. The frontend sends a
    message and waits for its answer, so nothing is read ahead of a message that has not
    arrived, and a read never waits for more than the message needs. Only the worker's
    loop reads the socket (its answers are written to the socket itself)."""

    __slots__ = ("sock", "data", "pos")

    def __init__(self, sock: Any) -> None:
        self.sock, self.data, self.pos = sock, b"", 0

    def recv(self, n: int) -> bytes:
        """Up to n bytes, as socket.recv gives them (TorchServe's own parser reads so)."""
        if self.pos >= len(self.data):
            got = self.sock.recv(max(n, READ_AHEAD))
            if len(got) <= n:  # all of it asked for (b"": the frontend hung up)
                return got
            self.data, self.pos = got, 0
        start, self.pos = self.pos, min(self.pos + n, len(self.data))
        return self.data[start:self.pos]

    def _fill(self, n: int) -> None:
        """At least n bytes from pos on; exits as TorchServe's worker does when the frontend hangs up."""
        chunks, have = [self.data[self.pos:]], len(self.data) - self.pos
        while have < n:
            got = self.sock.recv(max(n - have, READ_AHEAD))
            if not got:
                logging.info("Frontend disconnected.")
                sys.exit(0)
            chunks.append(got)
            have += len(got)
        self.data, self.pos = b"".join(chunks), 0

    def take(self, n: int) -> bytes:
        """Exactly n bytes (none for n <= 0, as TorchServe's parser)."""
        if n <= 0:
            return b""
        if len(self.data) - self.pos < n:
            self._fill(n)
        start = self.pos
        self.pos = start + n
        return self.data[start:self.pos]

    def int(self) -> int:
        if len(self.data) - self.pos < 4:
            self._fill(4)
        value = _INT.unpack_from(self.data, self.pos)[0]
        self.pos += 4
        return value


def read_message(reader: FrontendReader, log_request_line: bool = True) -> tuple[bytearray, Any]:
    """(command, message) as ts.protocol.otf_message_handler.retrieve_msg returns them.
    `log_request_line`: log TorchServe's per-request info line (it is dropped anyway in a
    worker where packrat.tslog's filter is on, so the record need not be made)."""
    cmd = bytearray(reader.take(1))
    if cmd == b"I":
        message = _inference(reader, os.environ.get("TS_DECODE_INPUT_REQUEST") in (None, "true"))
        if log_request_line:
            logging.info(REQUEST_LINE, time.time())
        return cmd, message
    if cmd == b"L":
        from ts.protocol.otf_message_handler import _retrieve_load_msg

        return cmd, _retrieve_load_msg(reader)
    raise ValueError("Invalid command: {}".format(cmd))


def _inference(r: FrontendReader, decode: bool) -> list[dict[str, Any]]:
    """A batch. The frame (the frontend's Java codec; ts/protocol/otf_message_handler.py):
    per request its id, its headers (name, value), its parameters (name, content type,
    value), each field a length and its bytes, -1 ending each list."""
    batch = []
    while (n := r.int()) != -1:
        request: dict[str, Any] = {"requestId": bytearray(r.take(n))}
        headers = []
        while (n := r.int()) != -1:
            name = bytearray(r.take(n))
            headers.append({"name": name, "value": bytearray(r.take(r.int()))})
        parameters = []
        while (n := r.int()) != -1:
            name = r.take(n).decode("utf-8")
            content_type = r.take(r.int()).decode("utf-8")
            parameters.append({"name": name, "contentType": content_type,
                               "value": _decoded(r.take(r.int()), content_type, decode)})
        request["headers"], request["parameters"] = headers, parameters
        batch.append(request)
    return batch


def _decoded(value: bytes, content_type: str, decode: bool) -> Any:
    """JSON and text bodies decoded as TorchServe 0.12's parser decodes them (unless
    TS_DECODE_INPUT_REQUEST is set to anything but "true"); others, and ones that do not
    decode, as a bytearray."""
    if decode and content_type == "application/json":
        try:
            return json.loads(value.decode("utf-8"))
        except Exception:  # what TorchServe catches: the body is passed on as it came
            logging.warning("Failed json decoding of input data. Forwarding encoded payload", exc_info=True)
    elif decode and content_type.startswith("text"):
        try:
            return value.decode("utf-8")
        except Exception:
            logging.warning("Failed utf-8 decoding of input data. Forwarding encoded payload", exc_info=True)
    return bytearray(value)
