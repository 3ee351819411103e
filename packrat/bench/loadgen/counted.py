"""Counted loads: a fixed number of measured HTTP requests, timed one by one.

Two modes:

* closed loop: `clients` threads, each with exactly one request outstanding.
  This is the load "batch B" of the design: B clients keep B requests in the
  system. A fixed number of requests is measured after a warm-up; clients keep
  sending (unrecorded) until the last measured request has completed, so every
  measured request saw the full concurrency, not the thinning tail.
* open loop: Poisson arrivals at `rate` requests/s, drawn in advance from a
  seeded generator. A request's latency counts from its *scheduled* arrival, so
  a server (or generator) that falls behind shows up as latency instead of
  silently lowering the offered rate (coordinated omission).

Each thread sends over its own keep-alive connection (connection.py says why).
`measure_capacity()` reports what this design reaches.
The result also carries the generator's own CPU time per request, so a reader
can see how much of the 2 cores the generator took during a measurement.
"""

from __future__ import annotations

import collections
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import urllib3

from packrat.bench.loadgen.connection import Connection, check_loopback
from packrat.bench.stats import percentile
from packrat.errors import ConfigError


@dataclass(frozen=True)
class Target:
    """Where and what to send: one POST per request."""

    url: str
    body: bytes = b""
    content_type: str = "application/octet-stream"
    token: str | None = None  # TorchServe inference key, sent as "Authorization: Bearer ..."
    timeout_s: float = 120.0

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": self.content_type}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h


@dataclass(frozen=True)
class RequestRecord:
    """One request: when it started (s, perf_counter clock), how long it took, how it ended."""

    start_s: float
    latency_ms: float
    status: int  # HTTP status; 0 when no answer came (connection error, timeout)
    error: str | None = None  # None for HTTP 2xx
    batch_size: int | None = None  # the worker's batch it was served in (x-packrat-batch-size), if told

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class LoadResult:
    """Summary of one measurement; latency percentiles over successful requests only."""

    mode: str  # "closed" or "open"
    clients: int
    rate_rps: float | None
    requested: int
    ok: int
    errors: int
    error_kinds: dict[str, int]
    duration_s: float
    throughput_rps: float
    mean_ms: float | None
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    generator_cpu_ms_per_request: float
    # Mean size of the batches answered requests were served in, as seen per request
    # (a batch of n counts n times); None when the server does not say.
    mean_batch_size: float | None = None
    records: tuple[RequestRecord, ...] = field(default=(), repr=False, compare=False)

    def summary(self) -> dict:
        """The fields worth saving (no per-request records)."""
        return {
            "mode": self.mode,
            "clients": self.clients,
            "rate_rps": self.rate_rps,
            "requested": self.requested,
            "ok": self.ok,
            "errors": self.errors,
            "error_kinds": dict(self.error_kinds),
            "duration_s": round(self.duration_s, 4),
            "throughput_rps": round(self.throughput_rps, 3),
            "mean_ms": _r(self.mean_ms),
            "p50_ms": _r(self.p50_ms),
            "p95_ms": _r(self.p95_ms),
            "p99_ms": _r(self.p99_ms),
            "max_ms": _r(self.max_ms),
            "generator_cpu_ms_per_request": round(self.generator_cpu_ms_per_request, 4),
            "mean_batch_size": _r(self.mean_batch_size),
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


# Set by the Packrat handler on every response: how many requests its batch held.
BATCH_SIZE_HEADER = "x-packrat-batch-size"


def _int_or_none(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


class _Client:
    """One generator thread's connection, its answers read as (status, error kind, batch size)."""

    def __init__(self, target: Target) -> None:
        self.conn = Connection(target.url, target.timeout_s)
        self.body = target.body
        self.headers = target.headers()

    def send(self) -> tuple[int, str | None, int | None]:
        try:
            resp = self.conn.post(self.body, self.headers)
        except urllib3.exceptions.NewConnectionError:
            # Checked first: urllib3 makes it a subclass of ConnectTimeoutError.
            return 0, "connection:refused", None
        except urllib3.exceptions.TimeoutError:
            return 0, "timeout", None
        except urllib3.exceptions.HTTPError as exc:  # connection refused/reset, protocol errors
            return 0, f"connection:{type(exc).__name__}", None
        if 200 <= resp.status < 300:
            return resp.status, None, _int_or_none(resp.headers.get(BATCH_SIZE_HEADER))
        return resp.status, f"http_{resp.status}", None

    def close(self) -> None:
        self.conn.close()


def summarise(
    records: Sequence[RequestRecord],
    *,
    mode: str,
    clients: int,
    rate_rps: float | None,
    requested: int,
    cpu_s: float,
    window_s: float | None = None,
) -> LoadResult:
    ok = [r.latency_ms for r in records if r.ok]
    sizes = [r.batch_size for r in records if r.ok and r.batch_size is not None]
    kinds = collections.Counter(r.error for r in records if not r.ok)
    if window_s is None:
        if records:
            first = min(r.start_s for r in records)
            last = max(r.start_s + r.latency_ms / 1000.0 for r in records)
            window_s = last - first
        else:
            window_s = 0.0
    return LoadResult(
        mode=mode,
        clients=clients,
        rate_rps=rate_rps,
        requested=requested,
        ok=len(ok),
        errors=len(records) - len(ok),
        error_kinds=dict(sorted(kinds.items())),
        duration_s=window_s,
        # Only answered requests count as work done.
        throughput_rps=(len(ok) / window_s) if window_s > 0 else 0.0,
        mean_ms=(sum(ok) / len(ok)) if ok else None,
        p50_ms=percentile(ok, 50),
        p95_ms=percentile(ok, 95),
        p99_ms=percentile(ok, 99),
        max_ms=max(ok) if ok else None,
        generator_cpu_ms_per_request=(cpu_s * 1000.0 / len(records)) if records else 0.0,
        mean_batch_size=(sum(sizes) / len(sizes)) if sizes else None,
        records=tuple(records),
    )


def _run_threads(body: Callable[[], None], n: int, name: str) -> float:
    """Run `body` in `n` threads until all return; the CPU seconds this process spent meanwhile."""
    cpu0 = time.process_time()
    threads = [threading.Thread(target=body, name=f"{name}-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.process_time() - cpu0


def closed_loop(
    target: Target,
    clients: int,
    requests_count: int,
    warmup: int | None = None,
    *,
    max_duration_s: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> LoadResult:
    """B = `clients` clients, one request outstanding each; `requests_count` measured requests.

    Tickets 0..warmup-1 are warm-up (sent, not recorded), the next
    `requests_count` are measured, and later tickets keep the concurrency up
    until every measured request has been answered. `max_duration_s` bounds the
    whole run: measured tickets not yet sent by then are dropped (reported by
    `requested` > `ok + errors`).
    """
    if clients < 1 or requests_count < 1:
        raise ConfigError("closed loop needs clients >= 1 and requests >= 1")
    check_loopback(target.url)
    warmup = max(clients * 2, 10) if warmup is None else warmup
    lock = threading.Lock()
    next_ticket = 0
    measured_done = 0
    all_done = threading.Event()
    records: list[RequestRecord] = []
    deadline = None if max_duration_s is None else time.perf_counter() + max_duration_s
    stop = threading.Event()

    def client() -> None:
        nonlocal next_ticket, measured_done
        conn = _Client(target)
        try:
            while not stop.is_set():
                with lock:
                    ticket = next_ticket
                    next_ticket += 1
                if ticket >= warmup + requests_count and all_done.is_set():
                    return
                if deadline is not None and time.perf_counter() > deadline:
                    stop.set()
                    return
                t0 = time.perf_counter()
                status, error, batch_size = conn.send()
                t1 = time.perf_counter()
                if warmup <= ticket < warmup + requests_count:
                    with lock:
                        records.append(RequestRecord(t0, (t1 - t0) * 1000.0, status, error, batch_size))
                        measured_done += 1
                        if measured_done == requests_count:
                            all_done.set()
                    if progress is not None:
                        progress(1)
                elif ticket >= warmup + requests_count and all_done.is_set():
                    return
        finally:
            conn.close()

    cpu_s = _run_threads(client, clients, "loadgen")
    # CPU spent on cool-down and warm-up requests is charged to the measured ones:
    # an upper bound on the generator's cost per request.
    return summarise(records, mode="closed", clients=clients, rate_rps=None, requested=requests_count, cpu_s=cpu_s)


def poisson_schedule(rate_rps: float, count: int, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of a Poisson process: exponential gaps with mean 1/rate."""
    if rate_rps <= 0 or count < 1:
        raise ConfigError("open loop needs rate > 0 and requests >= 1")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(count):
        t += rng.expovariate(rate_rps)
        out.append(t)
    return out


def open_loop(
    target: Target,
    rate_rps: float,
    requests_count: int,
    warmup: int | None = None,
    *,
    workers: int = 64,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> LoadResult:
    """Poisson arrivals at `rate_rps`; latency measured from each scheduled arrival.

    `workers` threads take arrivals in order; if all are busy, the next
    arrival waits and that wait is part of its latency (as it would be for a
    real client that cannot get an answer in time).
    """
    check_loopback(target.url)
    warmup = max(int(rate_rps), 10) if warmup is None else warmup
    total = warmup + requests_count
    schedule = poisson_schedule(rate_rps, total, seed)
    lock = threading.Lock()
    next_index = 0
    records: list[RequestRecord] = []
    t_origin = time.perf_counter() + 0.05  # let the threads start before the first arrival

    def worker() -> None:
        nonlocal next_index
        conn = _Client(target)
        try:
            while True:
                with lock:
                    i = next_index
                    next_index += 1
                if i >= total:
                    return
                due = t_origin + schedule[i]
                delay = due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                status, error, batch_size = conn.send()
                t1 = time.perf_counter()
                if i >= warmup:
                    with lock:
                        records.append(RequestRecord(due, (t1 - due) * 1000.0, status, error, batch_size))
                    if progress is not None:
                        progress(1)
        finally:
            conn.close()

    cpu_s = _run_threads(worker, workers, "loadgen-open")
    return summarise(
        records, mode="open", clients=workers, rate_rps=rate_rps, requested=requests_count, cpu_s=cpu_s
    )


def measure_capacity(
    target: Target, clients_list: Sequence[int] = (1, 2, 4, 8, 16, 32), requests_count: int = 2000
) -> list[LoadResult]:
    """Closed-loop throughput of this generator against `target` at several client counts.

    Against a server that does nothing this is the generator's own ceiling
    (plus the server's); compare the two to see which one limits.
    """
    return [closed_loop(target, c, requests_count) for c in clients_list]


def format_capacity(results: Sequence[LoadResult]) -> str:
    lines = ["| clients | throughput (req/s) | p50 ms | p99 ms | generator CPU ms/req | errors |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r.clients} | {r.throughput_rps:.0f} | {r.p50_ms or math.nan:.2f} | {r.p99_ms or math.nan:.2f}"
            f" | {r.generator_cpu_ms_per_request:.3f} | {r.errors} |"
        )
    return "\n".join(lines)
