"""Continuous closed-loop load with every answer checked, for swap tests and measurements.

`clients` threads each keep one request outstanding until stopped, each on
its own keep-alive urllib3 connection (cheapest per request on 2 shared cores,
see packrat.bench.loadgen), and record (start, latency, ok, status, error) for
every request, so a test can count failures and a script can compare latency
inside and outside a swap window.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import urllib3


@dataclass(frozen=True)
class Sample:
    start: float  # time.monotonic() at send
    latency_s: float
    ok: bool
    status: int
    error: str | None = None


# A check gets (request index, response body) and says whether the answer is right.
Check = Callable[[int, bytes], bool]


@dataclass
class ContinuousLoad:
    url: str
    headers: dict[str, str]
    bodies: Sequence[bytes]  # request i sends bodies[i % len(bodies)]
    check: Check
    clients: int = 8
    timeout_s: float = 120.0
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self, k: int) -> None:
        http = urllib3.PoolManager(maxsize=1, retries=False, timeout=self.timeout_s)
        i = k
        while not self._stop.is_set():
            body = self.bodies[i % len(self.bodies)]
            t0 = time.monotonic()
            try:
                r = http.request("POST", self.url, body=body, headers=self.headers)
                ok = r.status == 200 and self.check(i % len(self.bodies), r.data)
                err = None if ok else f"HTTP {r.status}: {r.data[:200]!r}"
                sample = Sample(t0, time.monotonic() - t0, ok, r.status, err)
            except Exception as exc:  # noqa: BLE001 - every failure is a counted sample
                sample = Sample(t0, time.monotonic() - t0, False, 0, repr(exc))
            with self._lock:
                self.samples.append(sample)
            i += self.clients
        http.clear()

    def start(self) -> "ContinuousLoad":
        for k in range(self.clients):
            t = threading.Thread(target=self._run, args=(k,), name=f"load-{k}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s)
        return list(self.samples)

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def failures(self) -> list[Sample]:
        return [s for s in self.snapshot() if not s.ok]

    def __enter__(self) -> "ContinuousLoad":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = min(len(xs) - 1, max(0, int(round(q / 100.0 * (len(xs) - 1)))))
    return xs[k]


def in_windows(samples: Sequence[Sample], windows: Sequence[tuple[float, float]]) -> list[Sample]:
    """Samples whose request overlapped any (start, end) window."""
    return [s for s in samples if any(s.start < b and s.start + s.latency_s > a for a, b in windows)]
