"""The batch estimator on metric sequences: synthetic ones with the arithmetic
beside each assert, and real TorchServe 0.12 scrapes (tests/data/observe/,
recorded by scripts/record_metrics.py against a 1-worker model that sleeps
50 ms per request)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packrat.observe.estimator import (
    Estimate,
    EstimatorSettings,
    EstimatorState,
    estimate,
    majority,
    round_pow2,
)
from packrat.observe.metrics import observation
from packrat.types import Observation

DATA = Path(__file__).parent / "data" / "observe"
S = EstimatorSettings()  # window 5 s, alpha 0.5, majority of 5; ticks of 1 s below


class Feed:
    """Synthetic counters: `run(c, seconds)` adds c concurrent requests of
    100 ms each for that long, i.e. 10·c requests/s and c·1e6 µs of latency per s."""

    def __init__(self, settings: EstimatorSettings = S) -> None:
        self.t, self.req, self.lat = 0.0, 0.0, 0.0
        self.state = EstimatorState()
        self.settings = settings
        self.out: list[Estimate] = [self._tick()]

    def _tick(self) -> Estimate:
        obs = Observation(self.t, "m", self.req, self.lat, queue_latency_us_total=0.0)
        est, self.state = estimate(self.state, obs, self.settings)
        return est

    def run(self, concurrency: float, seconds: int) -> list[Estimate]:
        new = []
        for _ in range(seconds):
            self.t += 1.0
            self.req += 10.0 * concurrency
            self.lat += concurrency * 1e6
            new.append(self._tick())
        self.out += new
        return new


def test_round_pow2_is_nearest_in_log_scale() -> None:
    # log2: 2.82 -> 1.50 (rounds to 1 -> 2), 2.83 -> 1.50+ (-> 4); 5.65/5.66 around 2.5
    assert [round_pow2(x) for x in (0.0, 0.5, 1.4, 1.5, 2.82, 2.9, 5.6, 5.7, 12.0, 5000)] == [
        1, 1, 1, 2, 2, 4, 4, 8, 16, 1024]


def test_majority_holds_without_a_majority() -> None:
    assert majority((1, 1, 2, 2, 4), 5, previous=1) == 1  # best count 2, not > 5/2
    assert majority((2, 4, 4, 4, 8), 5, previous=1) == 4  # 3 > 2.5
    assert majority((), 5, previous=8) == 8


def test_steady_load() -> None:
    f = Feed()
    est = f.run(4, 10)
    first = est[0]
    # t=1: window t0..t1: Δlat = 4e6 µs over 1 s -> concurrency 4.0; EWMA starts at 4
    assert first.concurrency == pytest.approx(4.0) and first.rounded == 4
    # one vote of 4 is not a majority of 5 yet (1 > 2.5 is false): B holds its
    # prior 1, which is no measurement: not ready
    assert first.batch == 1 and not first.ready
    # t=3: three votes of 4 (3 > 2.5) -> B = 4, ready from then on
    assert [(e.batch, e.ready) for e in est[:4]] == [(1, False), (1, False), (4, True), (4, True)]
    last = est[-1]
    # t=10: window t5..t10: Δlat = 5·4e6 µs / 5 s = 4.0; Δreq = 5·40 = 200
    assert last.span_s == 5.0 and last.concurrency == pytest.approx(4.0)
    assert last.request_rate == pytest.approx(40.0)  # 200 / 5 s
    assert last.mean_latency_ms == pytest.approx(100.0)  # 20e6 µs / 200 / 1000
    assert last.mean_queue_ms == 0.0 and last.batch == 4 and not last.idle


def test_step_jumps_straight_to_the_new_level() -> None:
    f = Feed()
    f.run(1, 10)
    assert f.out[-1].batch == 1
    est = f.run(8, 10)
    # k s after the step the 5 s window holds k s at 8 and 5-k at 1: c = (8k + 5 - k)/5.
    # k=1: 2.4 >= 2·B (B = 1): the first window of a step up, which began after the sample
    # at t=10; k=2: 3.8, the second in a row -> jump: the window restarts at t=10 and
    # reads (2·8e6 µs) / 2 s = 8.0 -> B = 8, EWMA 8, every vote 8
    assert [round(e.concurrency, 6) for e in est[:3]] == [2.4, 8.0, 8.0]
    assert [e.step for e in est[:3]] == [False, True, False]
    assert est[1].span_s == 2.0 and est[1].ewma == 8.0 and f.state.recent == (8,) * 5
    # (the majority alone took 7 ticks: votes 2, 2, 4, 4, 8, 8, 8 had no majority
    # of 8 before k=7.) Never 2 or 4 on the way.
    assert [e.batch for e in est] == [1] + [8] * 9
    # once a majority has formed, B stays "ready"
    assert all(e.ready for e in est)
    # the restarted window grows back to 5 s: k=3..7 span 3, 4, 5, 5, 5
    assert [e.span_s for e in est[2:7]] == [3.0, 4.0, 5.0, 5.0, 5.0]


def test_a_step_needs_two_windows_in_a_row() -> None:
    f = Feed()
    f.run(2, 10)
    # 1 s at 12 then 1 s at 0: k=1: (4·2 + 12)/5 = 4.0 >= 2·B (B = 2), a step up begins;
    # k=2: (3·2 + 12 + 0)/5 = 3.6 < 4, not a second window: no jump, B from the votes
    est = f.run(12, 1) + f.run(0, 1) + f.run(2, 6)
    assert [round(e.concurrency, 6) for e in est[:2]] == [4.0, 3.6]
    assert not any(e.step for e in est[:6])
    # the votes (EWMA 3.0, 3.3, 3.45: rounded 4) move B to 4 at k=3; when the 12 leaves the
    # window it reads 1.6 then 2.0, both <= 4/2: a step down, back to 2 at k=7
    assert [e.batch for e in est] == [2, 2, 4, 4, 4, 4, 2, 2] and est[6].step
    # the same 1 s at 12 followed by 2: k=2: (3·2 + 12 + 2)/5 = 4.0 again -> jump: the
    # window from t=10 reads (12 + 2)/2 = 7.0 -> B = 8 (a spike that big moves B; the
    # policy's min_stable_s is what lets it pass: test_observe_replay)
    g = Feed()
    g.run(2, 10)
    est = g.run(12, 1) + g.run(2, 1)
    assert [round(e.concurrency, 6) for e in est] == [4.0, 7.0] and est[1].step and est[1].batch == 8
    # a 3x ratio asks for 6: neither window is a step
    h = Feed(EstimatorSettings(step_ratio=3.0))
    h.run(2, 10)
    assert not any(e.step for e in h.run(12, 1) + h.run(2, 1))
    # one window asked for: the jump comes at k=1, on the window since t=10: 12e6 µs / 1 s
    i = Feed(EstimatorSettings(step_windows=1))
    i.run(2, 10)
    first = i.run(12, 1)[0]
    assert first.step and first.concurrency == 12.0 and first.batch == 16


def test_spike_shorter_than_the_window() -> None:
    f = Feed()
    f.run(2, 10)
    spike = f.run(8, 1)
    after = f.run(2, 10)
    est = spike + after
    # the 1 s spike sits in the 5 s window for 5 ticks: c = (8 + 4·2)/5 = 3.2
    assert [round(e.concurrency, 6) for e in est[:6]] == [3.2] * 5 + [2.0]
    # EWMA from 2: 2.6, 2.9, 3.05, 3.125, 3.1625, 2.58125 -> rounded 2, 4, 4, 4, 4, 2
    assert [e.rounded for e in est[:6]] == [2, 4, 4, 4, 4, 2]
    # 3.2 < 2·2: no step up; votes: (2,2,2,2,4) 2; (2,2,2,4,4) 2; (2,2,4,4,4) 4
    batches = [e.batch for e in est]
    # then B = 4 and the window reads 3.2, 3.2 (not <= 4/2), 2.0, 2.0: two windows in
    # a row at half of B -> jump back to 2 at k=7 (the majority alone took until k=8)
    assert batches[:8] == [2, 2, 2, 4, 4, 4, 2, 2]
    assert [e.step for e in est[:8]] == [False] * 6 + [True, False]
    # so B reads 4 for 3 ticks (3 s), less than the policy's min_stable_s (5 s),
    # and settles back to 2
    assert batches[-1] == 2


def test_idle_server_from_the_start() -> None:
    f = Feed()
    est = f.run(0, 10)
    # Δreq = Δlat = 0: concurrency 0, no latency (no division), idle, B = 1
    assert all(e.concurrency == 0.0 and e.mean_latency_ms is None and e.idle for e in est)
    assert all(e.batch == 1 for e in est)
    # three votes of 1 form a majority: a measured 1, not the prior
    assert [e.ready for e in est[:3]] == [False, False, True]


def test_load_then_idle_decays_to_one() -> None:
    f = Feed()
    f.run(8, 10)
    assert f.out[-1].batch == 8
    est = f.run(0, 15)
    # window: 6.4, 4.8, 3.2 (<= 8/2: a step down begins after the sample at k=2),
    # 1.6 (the second in a row) -> jump at k=4: the window from k=2 holds nothing: idle,
    # B = 1. EWMA from 8: 7.2, 6.0, 4.6, then the post-step window's 0
    assert [round(e.concurrency, 4) for e in est[:3]] == [6.4, 4.8, 3.2]
    assert [round(e.ewma, 4) for e in est[:4]] == [7.2, 6.0, 4.6, 0.0]
    # idle from k=4 on (the whole 5 s window emptied only at k=5)
    assert [e.idle for e in est[:6]] == [False] * 3 + [True] * 3
    assert [e.batch for e in est[:4]] == [8, 8, 8, 1] and est[3].step
    assert est[-1].batch == 1 and est[-1].ewma == 0.0 and est[-1].idle


def test_a_load_at_one_does_not_step_to_idle() -> None:
    # B = 1 cannot jump lower: the window decays as it always did (the gaps of a sparse
    # load are no step), idle once the whole 5 s window is empty
    f = Feed()
    f.run(1, 10)
    est = f.run(0, 6)
    # window 0.8, 0.6, 0.4 (<= 1/2), 0.2, 0, 0: a step down by the ratio, but B stays 1
    assert [round(e.concurrency, 4) for e in est] == [0.8, 0.6, 0.4, 0.2, 0.0, 0.0]
    assert not any(e.step for e in est) and [e.batch for e in est] == [1] * 6
    assert [e.idle for e in est] == [False] * 4 + [True] * 2


def test_counter_reset_rebaselines_and_keeps_the_estimate() -> None:
    f = Feed()
    f.run(4, 10)
    assert f.out[-1].batch == 4
    # TorchServe restarts: counters start again from 0 and have counted 1 s of load
    f.t += 1.0
    f.req, f.lat = 40.0, 4e6
    reset = f._tick()
    # a delta across the restart would be negative; it is skipped, B held
    assert reset.reset and not reset.ready and reset.batch == 4
    assert f.state.resets == 1 and len(f.state.samples) == 1
    est = f.run(4, 5)
    # the next tick measures from the restart: (8e6 - 4e6) µs / 1 s = 4.0
    assert est[0].ready and est[0].concurrency == pytest.approx(4.0)
    assert all(e.batch == 4 for e in est)


def test_window_stretches_for_slow_requests() -> None:
    # 8 requests of 3 s each in flight: 8/3 req/s, 8e6 µs of latency per s
    state, t, req, lat = EstimatorState(), 0.0, 0.0, 0.0
    spans = []
    for _ in range(20):
        est, state = estimate(state, Observation(t, "m", req, lat, 0.0))
        spans.append(est.span_s)
        t, req, lat = t + 1.0, req + 8 / 3, lat + 8e6
    # mean latency 8e6 / (8/3) µs = 3000 ms -> window max(5 s, 4 · 3 s) = 12 s
    assert state.latency_ms == pytest.approx(3000.0)
    # (the base is the newest 1 s tick at or before now - 12 s: span 12, or 13
    # when float rounding puts the window a hair above 12)
    assert 12.0 <= spans[-1] <= 13.0
    assert est.concurrency == pytest.approx(8.0) and est.batch == 8
    # fast requests keep the 5 s window (4 · 0.1 s < 5 s): see test_steady_load


def test_arrivals_without_answers_have_no_latency() -> None:
    # a load starts: 5 requests arrived in the window, none answered yet
    state = EstimatorState()
    _, state = estimate(state, Observation(0.0, "m", 0.0, 0.0, 0.0))
    est, _ = estimate(state, Observation(1.0, "m", 5.0, 0.0, 0.0))
    # Δlat = 0 over Δreq = 5 is no latency of 0 ms: unknown
    assert est.mean_latency_ms is None and est.mean_service_ms is None and not est.idle


def test_repeated_reading_changes_nothing() -> None:
    f = Feed()
    f.run(2, 5)
    before = f.state
    obs = Observation(f.t, "m", f.req, f.lat)  # same time as the last tick
    est, after = estimate(before, obs, S)
    assert after is before and not est.ready


def _replay(name: str, every: int = 2) -> list[tuple[float, int, Estimate]]:
    """Replay a recording at 1 s ticks (it was scraped every 0.5 s). Failed
    scrapes (server down) are skipped as the controller skips them."""
    state, out = EstimatorState(), []
    for i, line in enumerate((DATA / f"{name}.jsonl").read_text().splitlines()):
        if i % every:
            continue
        d = json.loads(line)
        if d["text"].startswith("# scrape failed"):
            continue
        est, state = estimate(state, observation(d["text"], "tiny", d["t"]), S)
        out.append((d["t"], d["clients"], est))
    return out


def _changes(seq: list[int]) -> list[int]:
    return [v for i, v in enumerate(seq) if i == 0 or v != seq[i - 1]]


def test_recorded_steps() -> None:
    # 0 clients 3 s, 1 client 8 s, 8 clients 10 s, 2 clients 10 s, 0 for 8 s
    rec = _replay("steps")
    assert _changes([e.batch for _, _, e in rec]) == [1, 8, 2, 1]
    # steady parts: with 1 worker the queue counts too, so concurrency ~ clients
    at8 = [e.concurrency for t, c, e in rec if c == 8 and e.batch == 8]
    assert at8 and min(at8) > 5.66  # rounds to 8, not 4
    # how long B took to follow each level change (the level is stamped on scrapes)
    def lag(level: int) -> float:
        t0 = next(t for t, c, _ in rec if c == level)
        return next(t for t, c, e in rec if t >= t0 and e.batch == level) - t0
    assert lag(8) <= 9.0 and lag(2) <= 10.0


def test_recorded_spike_returns() -> None:
    # 2 clients 8 s, 8 clients 1 s, 2 clients 10 s
    rec = _replay("spike")
    batches = [e.batch for _, _, e in rec]
    assert batches[-1] == 2
    settled = batches.index(2)  # after warm-up (B starts at 1)
    # the excursion (if any) lasts < 5 s = PolicySettings.min_stable_s
    times = [t for t, _, e in rec[settled:] if e.batch != 2]
    assert not times or times[-1] - times[0] < 5.0


def test_recorded_restart() -> None:
    # 2 clients throughout; TorchServe killed at ~8 s and started again
    rec = _replay("reset")
    resets = [e for _, _, e in rec if e.reset]
    assert len(resets) == 1
    assert max(e.batch for _, _, e in rec) == 2
    assert rec[-1][2].batch == 2
