"""The load generator against a tiny loopback server: counts, percentiles, errors, auth header;
and ContinuousLoad's accounting (every request counted, per-client progress).

No speed thresholds: what a loaded 2-core machine can slow down (throughput,
how long a run takes) is bounded only from the side a slow machine cannot
break; the generator's measured capacity is in docs/serving-benchmark.md."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import pytest

from packrat.bench.loadgen import (
    RequestRecord,
    Target,
    closed_loop,
    open_loop,
    percentile,
    poisson_schedule,
    summarise,
)
from packrat.bench.loadgen import ContinuousLoad
from packrat.bench.localserver import LocalServer, local_server
from packrat.errors import ConfigError
from waiting import wait_until


def server_requests(server: LocalServer) -> int:
    """Requests the server has seen so far (its counter hands out 1, 2, ...; peeking takes one)."""
    seen = next(server.counter) - 1
    server.counter = itertools.count(seen + 1)
    return seen


@pytest.fixture()
def server() -> Iterator[LocalServer]:
    with local_server() as srv:
        yield srv


def _url(srv: LocalServer, query: str = "") -> str:
    return f"http://127.0.0.1:{srv.port}/predictions/noop{query}"


def test_percentile_matches_linear_interpolation() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    # linear: position q/100 * (n-1) = 0.5*99 = 49.5 -> between 50 and 51
    assert percentile(values, 50) == pytest.approx(50.5)
    # 0.99*99 = 98.01 -> 99 + 0.01*(100-99)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([], 50) is None


def test_summarise_counts_errors_and_excludes_them_from_latency() -> None:
    recs = [RequestRecord(0.0, 10.0, 200), RequestRecord(0.0, 1000.0, 500, "http_500"),
            RequestRecord(0.01, 20.0, 0, "timeout"), RequestRecord(0.02, 30.0, 200)]
    res = summarise(recs, mode="closed", clients=2, rate_rps=None, requested=4, cpu_s=0.004)
    assert (res.ok, res.errors) == (2, 2)
    assert res.error_kinds == {"http_500": 1, "timeout": 1}
    assert res.p50_ms == pytest.approx(20.0)  # median of the two successes 10 and 30
    assert res.max_ms == 30.0
    # window: first start 0.0 to last end 0.0 + 1.0 s (the 500 took 1000 ms) -> 2 ok / 1 s
    assert res.throughput_rps == pytest.approx(2.0)
    assert res.generator_cpu_ms_per_request == pytest.approx(1.0)  # 4 ms / 4 requests


def test_closed_loop_sends_measured_count_with_token(server: LocalServer) -> None:
    res = closed_loop(Target(_url(server), body=b"x", token="tok123"), clients=4, requests_count=200, warmup=20)
    assert res.ok == 200 and res.errors == 0 and len(res.records) == 200
    sent = server_requests(server)
    # 20 warm-up + 200 measured, plus cool-down requests that keep 4 in flight until the
    # last measured one is answered. How many depends on scheduling (a descheduled
    # client lets the others send more), so bound it only from below, and check that
    # the cool-down really ends: no request arrives after closed_loop returned.
    assert sent >= 220
    time.sleep(0.3)
    assert server_requests(server) == sent
    assert set(server.auth_seen) == {"Bearer tok123"}
    assert res.p50_ms is not None and res.p50_ms <= res.p95_ms <= res.p99_ms <= res.max_ms


def max_overlap(records) -> int:
    """Most requests in flight at one instant, from the records' own start and end times."""
    events = sorted([(r.start_s, 1) for r in records] + [(r.start_s + r.latency_ms / 1000.0, -1) for r in records],
                    key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    depth = most = 0
    for _, step in events:
        depth += step
        most = max(most, depth)
    return most


def test_closed_loop_latency_and_concurrency_follow_server_delay(server: LocalServer) -> None:
    # Every request sleeps 20 ms; 5 clients -> ~5 requests per 20 ms = ~250 req/s at most.
    res = closed_loop(Target(_url(server, "?sleep_ms=20")), clients=5, requests_count=100, warmup=5)
    assert res.p50_ms >= 20.0
    assert res.throughput_rps <= 5 / 0.020 * 1.05
    # Concurrency really was several clients, never more than 5 (overlap of the
    # requests' own intervals: a slow machine stretches them, it cannot serialise 5
    # threads that each wait 20 ms on a socket).
    overlap = max_overlap(res.records)
    print(f"max requests in flight: {overlap}, {res.throughput_rps:.0f} req/s")
    assert 2 <= overlap <= 5


def test_closed_loop_counts_http_errors(server: LocalServer) -> None:
    # Every 4th request of the server's life gets HTTP 500. With warmup=0 and one client
    # the measured requests are exactly the server's requests 1..100 -> 25 failures.
    res = closed_loop(Target(_url(server, "?fail_every=4")), clients=1, requests_count=100, warmup=0)
    assert (res.ok, res.errors) == (75, 25)
    assert res.error_kinds == {"http_500": 25}


def test_connection_errors_are_recorded_not_raised() -> None:
    srv = LocalServer(0)
    port = srv.port
    srv.server_close()  # nothing listens on the port any more
    res = closed_loop(Target(f"http://127.0.0.1:{port}/x", timeout_s=2), clients=2, requests_count=10, warmup=0)
    assert res.ok == 0 and res.errors == 10
    assert all(k.startswith("connection") for k in res.error_kinds)
    assert res.p50_ms is None and res.throughput_rps == 0.0


def test_closed_loop_refuses_non_loopback() -> None:
    with pytest.raises(ConfigError):
        closed_loop(Target("http://192.0.2.1:8080/x"), clients=1, requests_count=1)


def test_poisson_schedule_is_seeded_with_the_right_mean() -> None:
    a = poisson_schedule(100.0, 5000, seed=7)
    assert a == poisson_schedule(100.0, 5000, seed=7)
    assert all(x < y for x, y in zip(a, a[1:]))
    # 5000 arrivals at 100/s take ~50 s; the mean of exp(100) gaps has sd 0.01/sqrt(5000).
    assert a[-1] == pytest.approx(50.0, rel=0.05)


def test_open_loop_keeps_the_offered_rate(server: LocalServer) -> None:
    schedule = poisson_schedule(200.0, 220, seed=1)
    t0 = time.perf_counter()
    res = open_loop(Target(_url(server)), rate_rps=200.0, requests_count=200, warmup=20, workers=8, seed=1)
    elapsed = time.perf_counter() - t0
    assert res.ok == 200 and res.errors == 0
    # The offered load is the seeded schedule: each measured request is timed from
    # its own scheduled arrival (warm-up arrivals 0-19 are not recorded) ...
    starts = sorted(r.start_s for r in res.records)
    offsets = [t - starts[0] for t in starts]
    assert offsets == pytest.approx([t - schedule[20] for t in schedule[20:]], abs=1e-9)
    # ... and nothing is sent early: the run lasts at least the schedule, and the
    # answered rate cannot exceed the scheduled one (a slow machine only lowers it).
    assert elapsed >= schedule[-1]
    assert res.throughput_rps <= 200 / (schedule[-1] - schedule[20]) * (1 + 1e-9)
    print(f"open loop: {res.throughput_rps:.0f} req/s answered of {200 / (schedule[-1] - schedule[20]):.0f} scheduled")


def test_open_loop_charges_queueing_to_latency(server: LocalServer) -> None:
    # One worker, each request 20 ms, arrivals at 200/s (5 ms apart): the worker falls
    # behind, so latency from the scheduled arrival grows far beyond the 20 ms service time.
    res = open_loop(Target(_url(server, "?sleep_ms=20")), rate_rps=200.0, requests_count=40, warmup=0, workers=1)
    assert res.ok == 40
    assert res.max_ms > 200.0


def test_continuous_load_counts_a_stuck_request_and_sees_the_stuck_client(server: LocalServer) -> None:
    """A client whose request never completes is reported by wait_progress() while
    the others are served, and stop() counts its request as failed instead of
    dropping it."""
    release = threading.Event()
    bodies = [b"a", b"b", b"c", b"d"]
    # Client 0 sends bodies[0] only; its answer check blocks: its request never finishes.
    # The request timeout only bounds how long stop() waits for it: generous enough that
    # no request of the others, on a loopback no-op server, reaches it unless stuck.
    load = ContinuousLoad(url=_url(server), headers={}, bodies=bodies,
                          check=lambda i, body: i != 0 or release.wait(60), clients=4,
                          timeout_s=3.0, stop_grace_s=0.5)
    try:
        with load:
            t, before = time.monotonic(), load.per_client()
            # Two more finished requests per client: the second was sent after t.
            wait_until(lambda: all(n >= b + 2 for n, b in zip(load.per_client()[1:], before[1:])), 60,
                       "two more answers for each client but the stuck one")
            assert load.wait_progress(t, timeout_s=0.1) == [0]
        # The with block's exit stopped it (waiting out the stuck request's timeout); another
        # stop() returns the same samples at once instead of waiting that long again.
        t = time.monotonic()
        samples = load.stop()
        assert time.monotonic() - t < 1.0
        stuck = [s for s in samples if not s.ok]
        assert len(stuck) == 1 and stuck[0].client == 0 and stuck[0].error.startswith("stuck"), stuck
        assert all(s.ok for s in samples if s.client != 0) and len(samples) > 3
        assert load.per_client()[0] == 0 and all(n > 0 for n in load.per_client()[1:])
    finally:
        release.set()
    # The late answer does not turn into a second sample for the same request.
    load._threads[0].join(timeout=10)
    assert len(load.snapshot()) == len(samples)
