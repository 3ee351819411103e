"""A trivial loopback HTTP server: the yardstick that separates generator cost from server cost.

It answers every POST at once (HTTP/1.1 keep-alive, one thread per connection),
so a closed loop against it measures mostly the load generator. Tests use its
knobs, taken from the query string:

* `?sleep_ms=20`  wait before answering;
* `?fail_every=5` answer HTTP 500 to every 5th request (1-based count per server).

Run on its own (`python -m packrat.bench.localserver --port 0`) to keep it off
the generator's GIL; it prints "listening on PORT" once ready.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as TorchServe's front end does
    # Headers and body go out in separate writes; with Nagle on, the body then
    # waits ~40 ms for the client's delayed ACK on every request.
    disable_nagle_algorithm = True

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        query = parse_qs(urlsplit(self.path).query)
        n = next(self.server.counter)  # type: ignore[attr-defined]
        self.server.auth_seen.append(self.headers.get("Authorization"))  # type: ignore[attr-defined]
        sleep_ms = float(query.get("sleep_ms", ["0"])[0])
        if sleep_ms:
            time.sleep(sleep_ms / 1000.0)
        fail_every = int(query.get("fail_every", ["0"])[0])
        status = 500 if fail_every and n % fail_every == 0 else 200
        body = b'{"ok": true}' if status == 200 else b'{"code": 500, "message": "planned failure"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # quiet: one line per request would dominate
        pass


class LocalServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        # itertools.count's next() is atomic under the GIL; counts from 1.
        self.counter = itertools.count(1)
        self.auth_seen: list[str | None] = []

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start_in_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name="localserver", daemon=True)
        t.start()
        return t


@contextlib.contextmanager
def local_server(port: int = 0) -> Iterator[LocalServer]:
    """A LocalServer answering in a thread of this process, shut down on exit."""
    srv = LocalServer(port)
    srv.start_in_thread()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    server = LocalServer(args.port)
    print(f"listening on {server.port}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main(sys.argv[1:])
