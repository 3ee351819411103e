"""The one HTTP client every load uses: one keep-alive urllib3 connection per sending thread.

Why urllib3 with one connection per thread: on 2 cores the generator shares
the CPU with the server it measures, so what matters is CPU per request, not
peak concurrency. A keep-alive connection per thread means no per-request
handshake, and the GIL is released while waiting on the socket. Measured here
against a trivial local server, one request cost the client ~1.0 ms of CPU
with requests.Session, ~0.3 ms with urllib3 and ~0.16 ms with bare
http.client; urllib3 keeps most of that saving and still handles reconnects
and timeouts.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import urllib3

from packrat.errors import ConfigError

# Only 127.0.0.1/localhost: the generator is for loopback servers (see COMMON rules).
_ALLOWED_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def check_loopback(url: str) -> None:
    host = urlsplit(url).netloc.rsplit("@", 1)[-1]
    host = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
    if host not in _ALLOWED_HOSTS:
        raise ConfigError(f"load generator only targets loopback servers, not {url!r}")


class Connection:
    """POSTs to one URL over one keep-alive connection; not shared between threads."""

    def __init__(self, url: str, timeout_s: float) -> None:
        check_loopback(url)
        parts = urlsplit(url)
        self.path = parts.path + (f"?{parts.query}" if parts.query else "")
        # retries=False: a failed request is a result to record, never silently re-sent.
        # A total timeout, not a per-read one: a server that trickles bytes must not keep
        # a request open past timeout_s.
        self.pool = urllib3.HTTPConnectionPool(
            parts.hostname, parts.port or 80, maxsize=1, block=True, retries=False,
            timeout=urllib3.Timeout(total=timeout_s),
        )

    def post(self, body: bytes, headers: dict[str, str]) -> urllib3.BaseHTTPResponse:
        """The whole answer (preload_content reads the body: a response is complete only
        then); raises urllib3.exceptions.HTTPError when no answer came."""
        return self.pool.urlopen("POST", self.path, body=body, headers=headers, redirect=False)

    def close(self) -> None:
        self.pool.close()
