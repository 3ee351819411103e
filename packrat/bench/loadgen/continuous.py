"""Continuous closed-loop load with every answer checked, for swap tests and measurements.

`clients` threads each keep one request outstanding until stopped, each on
its own keep-alive connection (connection.py), and record (start, latency, ok, status, error,
client) for every request, so a test can count failures and a script can
compare latency inside and outside a swap window.

Every request is accounted for. stop() waits for each client's last request
until that request's own timeout has passed (plus a grace period); a request
still unanswered then is recorded as a failed sample ("stuck"), never dropped.
Progress is kept per client, so one client stuck behind a retired version
shows up even while the others are served (wait_progress()).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from packrat.bench.loadgen.connection import Connection, check_loopback
from packrat.bench.stats import percentile

# stop() waits this long past a request's timeout before it calls the request stuck:
# the client thread needs a moment to notice the timeout and record it itself.
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class Sample:
    start: float  # time.monotonic() at send
    latency_s: float
    ok: bool
    status: int
    error: str | None = None
    client: int = -1  # which client thread sent it


# A check gets (request index, response body) and says whether the answer is right.
Check = Callable[[int, bytes], bool]


@dataclass
class ContinuousLoad:
    url: str
    headers: dict[str, str]
    bodies: Sequence[bytes]  # request i sends bodies[i % len(bodies)]
    check: Check
    clients: int = 8
    timeout_s: float = 120.0  # per request, from send to the last byte of the answer
    stop_grace_s: float = STOP_GRACE_S
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition | None = None
    # Per client: send time of the request in flight (None between requests), and the
    # send time of the latest request it finished (answered or failed).
    _in_flight: list[float | None] = field(default_factory=list)
    _last_finished_start: list[float | None] = field(default_factory=list)
    _done: list[int] = field(default_factory=list)
    _stopped: bool = False

    def __post_init__(self) -> None:
        check_loopback(self.url)
        self._changed = threading.Condition(self._lock)
        self._in_flight = [None] * self.clients
        self._last_finished_start = [None] * self.clients
        self._done = [0] * self.clients

    def _run(self, k: int) -> None:
        conn = Connection(self.url, self.timeout_s)
        i = k
        while not self._stop.is_set():
            body = self.bodies[i % len(self.bodies)]
            t0 = time.monotonic()
            with self._lock:
                self._in_flight[k] = t0
            try:
                r = conn.post(body, self.headers)
                ok = r.status == 200 and self.check(i % len(self.bodies), r.data)
                err = None if ok else f"HTTP {r.status}: {r.data[:200]!r}"
                sample = Sample(t0, time.monotonic() - t0, ok, r.status, err, k)
            except Exception as exc:  # noqa: BLE001 - every failure is a counted sample
                sample = Sample(t0, time.monotonic() - t0, False, 0, repr(exc), k)
            with self._lock:
                if self._stopped:
                    break  # stop() already counted this request as stuck
                self.samples.append(sample)
                self._in_flight[k] = None
                self._last_finished_start[k] = t0
                self._done[k] += 1
                self._changed.notify_all()
            i += self.clients
        conn.close()

    def start(self) -> "ContinuousLoad":
        for k in range(self.clients):
            t = threading.Thread(target=self._run, args=(k,), name=f"load-{k}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> list[Sample]:
        """Stop sending; wait for every client's last request; return every sample.

        A request still unanswered after its timeout plus stop_grace_s is added
        as a failed sample with error "stuck: ...": every request sent is counted.
        Once stopped, another stop() (a `with` block's exit, then the caller's) returns
        the same samples at once: a stuck request was counted by the first.
        """
        with self._lock:
            if self._stopped:
                return list(self.samples)
        self._stop.set()
        deadline = time.monotonic() + self.timeout_s + self.stop_grace_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            if not self._stopped:
                self._stopped = True
                now = time.monotonic()
                for k, t0 in enumerate(self._in_flight):
                    if t0 is not None and self._threads[k].is_alive():
                        self.samples.append(Sample(
                            t0, now - t0, False, 0,
                            f"stuck: no answer {now - t0:.0f} s after send (client {k})", k))
                        self._in_flight[k] = None
            return list(self.samples)

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def failures(self) -> list[Sample]:
        return [s for s in self.snapshot() if not s.ok]

    def per_client(self) -> list[int]:
        """Requests each client has finished so far (answered or failed)."""
        with self._lock:
            return list(self._done)

    def wait_progress(self, since: float, timeout_s: float | None = None) -> list[int]:
        """Wait until every client has finished a request it sent at or after `since`
        (a time.monotonic() value); return the clients that had not within `timeout_s`
        (default: one request timeout). [] means every client got through.
        """
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

        def behind() -> list[int]:
            return [k for k, t in enumerate(self._last_finished_start) if t is None or t < since]

        with self._changed:
            while behind() and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(timeout=min(left, 1.0))
            return behind()

    def __enter__(self) -> "ContinuousLoad":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def in_windows(samples: Sequence[Sample], windows: Sequence[tuple[float, float]]) -> list[Sample]:
    """Samples whose request overlapped any (start, end) window."""
    return [s for s in samples if any(s.start < b and s.start + s.latency_s > a for a, b in windows)]


def latency_summary(samples: Sequence[Sample], digits: int = 1) -> dict:
    """Requests, failures, and p50/p99/max latency (ms) of the answered ones, rounded to `digits`."""
    lat = [s.latency_s * 1000 for s in samples if s.ok]
    return {"requests": len(samples), "failed": sum(not s.ok for s in samples),
            "p50_ms": round(percentile(lat, 50) or 0, digits), "p99_ms": round(percentile(lat, 99) or 0, digits),
            "max_ms": round(max(lat), digits) if lat else None}
