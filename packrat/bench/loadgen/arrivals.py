"""An open loop until stopped: Poisson arrivals, every answer checked (long soak runs).

Unlike counted.open_loop (a fixed number of measured requests), this keeps
sending at `rate_rps` until stop(); each arrival is handed to a pool thread, so a
slow server does not slow the arrivals down. A request whose answer does not
come within the timeout is "lost"; a wrong or refused answer is "failed".
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import urllib3

from packrat.bench.loadgen.connection import Connection
from packrat.bench.loadgen.continuous import Check


class PoissonLoad:
    """Records one dict per request: i, start (time.monotonic), status, outcome, error, latency_s."""

    def __init__(self, url: str, headers: Callable[[], dict[str, str]], rate_rps: float,
                 body: Callable[[int], bytes], check: Check, *, timeout_s: float = 120.0,
                 threads: int = 256, seed: int = 14) -> None:
        self.url, self.headers, self.rate_rps, self.timeout_s = url, headers, rate_rps, timeout_s
        self.body, self.check, self.seed = body, check, seed
        Connection(url, timeout_s).close()  # refuses a non-loopback URL now, not in a pool thread
        self.pool = ThreadPoolExecutor(threads)
        self.local = threading.local()  # one connection per pool thread
        self.results: list[dict] = []
        self.lock = threading.Lock()
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._drive, daemon=True)
        self.connections: list[Connection] = []
        self.sent = 0

    def _connection(self) -> Connection:
        if not hasattr(self.local, "conn"):
            self.local.conn = Connection(self.url, self.timeout_s)
            with self.lock:
                self.connections.append(self.local.conn)
        return self.local.conn

    def _one(self, i: int) -> None:
        t0 = time.monotonic()
        rec: dict = {"i": i, "start": t0}
        try:
            r = self._connection().post(self.body(i), self.headers())
            ok = r.status == 200 and self.check(i, r.data)
            rec.update(status=r.status, outcome="ok" if ok else "failed",
                       error=None if ok else r.data[:200].decode(errors="replace"))
        except urllib3.exceptions.ReadTimeoutError as exc:
            rec.update(status=0, outcome="lost", error=repr(exc)[:200])
        except Exception as exc:  # noqa: BLE001 - every failure is counted
            rec.update(status=0, outcome="failed", error=repr(exc)[:200])
        rec["latency_s"] = round(time.monotonic() - t0, 4)
        with self.lock:
            self.results.append(rec)

    def _drive(self) -> None:
        rng = random.Random(self.seed)
        nxt = time.monotonic()
        while not self.stop_flag.is_set():
            nxt += rng.expovariate(self.rate_rps)
            delay = nxt - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.pool.submit(self._one, self.sent)
            self.sent += 1

    def start(self) -> "PoissonLoad":
        self.thread.start()
        return self

    def stop(self) -> list[dict]:
        """Stop the arrivals, wait for every request sent, return every record."""
        self.stop_flag.set()
        self.thread.join()
        self.pool.shutdown(wait=True)
        for conn in self.connections:
            conn.close()
        return self.results
