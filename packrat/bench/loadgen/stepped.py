"""A closed-loop load that steps its concurrency over time (1 -> 8 -> 2 ...).

Used to test and to trace adaptation: client i keeps one request outstanding
while the current level is above i, so the live batch B follows the schedule.
Every request is recorded (start, end, HTTP status, level) for latency plots
and the "no request failed" check. Loopback only; each client thread on its own
keep-alive connection (connection.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import urllib3

from packrat.bench.loadgen.connection import Connection, check_loopback
from packrat.errors import ConfigError


@dataclass(frozen=True)
class Step:
    clients: int
    duration_s: float


@dataclass(frozen=True)
class Sent:
    start_s: float  # on the generator's clock (time.monotonic)
    end_s: float
    status: int  # HTTP status, 0 for a transport error
    level: int  # clients active when the request was sent
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def latency_ms(self) -> float:
        return (self.end_s - self.start_s) * 1000.0


class StepLoad:
    """Run `steps` against `url` in background threads; `join()` returns the records."""

    def __init__(
        self,
        url: str,
        steps: Sequence[Step],
        headers: Callable[[], dict[str, str]] | dict[str, str] | None = None,
        body: bytes = b"x",
        timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_loopback(url)
        if not steps or any(s.clients < 0 or s.duration_s <= 0 for s in steps):
            raise ConfigError(f"bad steps: {steps!r}")
        self.url = url
        self.steps = tuple(steps)
        self._headers = headers
        self.body = body
        self.timeout_s = timeout_s
        self.clock = clock
        self.level = 0
        self.records: list[Sent] = []
        self.level_changes: list[tuple[float, int]] = []  # (time, clients)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.started_s: float | None = None

    def _hdrs(self) -> dict[str, str]:
        h = self._headers() if callable(self._headers) else (self._headers or {})
        return dict(h)

    def _client(self, i: int) -> None:
        conn = Connection(self.url, self.timeout_s)
        while not self._stop.is_set():
            if self.level <= i:
                time.sleep(0.01)
                continue
            level = self.level
            t0 = self.clock()
            status, err = 0, None
            try:
                r = conn.post(self.body, self._hdrs())
                status = r.status
                if status != 200:
                    err = r.data.decode(errors="replace")[:200]
            except urllib3.exceptions.HTTPError as exc:
                err = repr(exc)[:200]
            rec = Sent(t0, self.clock(), status, level, err)
            with self._lock:
                self.records.append(rec)
        conn.close()

    def _driver(self) -> None:
        for step in self.steps:
            self.level = step.clients
            self.level_changes.append((self.clock(), step.clients))
            if self._stop.wait(step.duration_s):
                break
        self.level = 0
        self.level_changes.append((self.clock(), 0))
        self._stop.set()

    def start(self) -> "StepLoad":
        n = max(s.clients for s in self.steps)
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(n)]
        self._threads.append(threading.Thread(target=self._driver, daemon=True))
        self.started_s = self.clock()
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float | None = None) -> list[Sent]:
        for t in self._threads:
            t.join(timeout_s)
        with self._lock:
            return list(self.records)

    @property
    def running(self) -> bool:
        return not self._stop.is_set()
