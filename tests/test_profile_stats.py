"""The stop rule, driven by a fake clock: each call advances time by a scripted duration."""

from __future__ import annotations

import itertools
import math

import pytest

from packrat.profile.stats import StopRule, ci_half_width, measure


class FakeTimer:
    """clock() returns fake seconds; call() advances it by the next scripted duration (ms)."""

    def __init__(self, durations_ms):
        self.now = 0.0
        self.calls = 0
        self._durations = iter(durations_ms)

    def clock(self) -> float:
        return self.now

    def call(self) -> None:
        self.calls += 1
        self.now += next(self._durations) / 1000.0


def test_ci_half_width_matches_hand_calculation():
    # mean 2, sample std 1, t(0.975, dof 2) = 4.302653, half-width = 4.302653 / sqrt(3)
    assert ci_half_width([1.0, 2.0, 3.0]) == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    assert math.isinf(ci_half_width([5.0]))


def test_constant_latency_stops_at_min_count():
    rule = StopRule(min_count=5, warmup_calls=2, warmup_s=0.0, point_budget_s=100)
    timer = FakeTimer(itertools.repeat(10.0))
    stats = measure(timer.call, rule, clock=timer.clock)
    # std 0 -> the CI is 0 wide as soon as min_count samples exist
    assert stats.count == 5 and stats.converged
    assert stats.warmup_calls == 2 and timer.calls == 2 + 5
    assert stats.mean_ms == pytest.approx(10.0) and stats.std_ms == pytest.approx(0.0)


def test_stops_at_first_sample_count_whose_ci_is_within_5_percent():
    # alternating 10, 14, 10, 14, ... (after 2 warm-up calls): mean 12, std ~2.0
    # the half-width shrinks like 1/sqrt(n); find where it first reaches 5 % by brute force
    rule = StopRule(min_count=5, warmup_calls=2, warmup_s=0.0, point_budget_s=1000)
    pattern = [10.0, 14.0]
    timed = [pattern[i % 2] for i in range(1000)]
    expected_n = next(
        n for n in range(rule.min_count, 1000)
        if ci_half_width(timed[:n]) <= 0.05 * (sum(timed[:n]) / n)
    )
    timer = FakeTimer([99.0, 99.0] + timed)
    stats = measure(timer.call, rule, clock=timer.clock)
    assert stats.converged and stats.count == expected_n
    assert ci_half_width(timed[: expected_n - 1]) > 0.05 * (sum(timed[: expected_n - 1]) / (expected_n - 1))
    assert stats.ci_half_width_ms <= 0.05 * stats.mean_ms
    # more 10s than 14s when the count is odd, as many when even
    expected_p50 = 10.0 if expected_n % 2 else 12.0
    assert stats.p50_ms == pytest.approx(expected_p50) and stats.p99_ms == pytest.approx(14.0)


def test_noisy_point_stops_when_its_budget_is_spent():
    # 1 ms and 100 ms alternately never reach a 5 % CI within 2 s
    rule = StopRule(min_count=5, warmup_calls=2, warmup_s=0.0, point_budget_s=2.0)
    timer = FakeTimer(itertools.cycle([1.0, 100.0]))
    stats = measure(timer.call, rule, clock=timer.clock)
    assert not stats.converged
    assert 2.0 <= timer.now < 2.0 + 0.1 + 1e-9  # overshoot at most one call
    assert stats.ci_half_width_ms > 0.05 * stats.mean_ms


def test_call_longer_than_budget_gives_one_unconverged_sample():
    rule = StopRule(point_budget_s=1.0)
    timer = FakeTimer(itertools.repeat(3000.0))
    stats = measure(timer.call, rule, clock=timer.clock)
    assert stats.count == 1 and stats.std_ms is None and not stats.converged
    assert stats.warmup_calls == 1  # the first call always runs, then the budget is gone
    assert stats.mean_ms == pytest.approx(3000.0)


def test_deadline_reached_in_warm_up_omits_the_point():
    rule = StopRule(point_budget_s=10.0)
    timer = FakeTimer(itertools.repeat(500.0))
    assert measure(timer.call, rule, deadline=0.4, clock=timer.clock) is None


def test_deadline_cuts_measurement_short():
    rule = StopRule(point_budget_s=100.0, warmup_calls=1, warmup_s=0.0)
    timer = FakeTimer(itertools.cycle([1.0, 100.0]))
    stats = measure(timer.call, rule, deadline=3.0, clock=timer.clock)
    assert stats is not None and not stats.converged
    assert timer.now < 3.0 + 0.1 + 1e-9


def test_bad_rule_is_rejected():
    with pytest.raises(ValueError):
        StopRule(rel_ci=0)
    with pytest.raises(ValueError):
        StopRule(min_count=1)


def test_batch_sizes_are_powers_of_two_plus_the_maximum():
    from packrat.profile import batch_sizes

    assert batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert batch_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert batch_sizes(1) == [1]


def test_budget_is_shared_in_proportion_to_one_over_t():
    from packrat.profile.runner import budget_share

    # T=2, 180 s left before t=1: weights 1 and 1/2 -> t=1 gets 180 * 1 / 1.5 = 120 s
    assert budget_share(180.0, 1, 2) == pytest.approx(120.0)
    # the last thread count gets everything that is left
    assert budget_share(75.0, 2, 2) == pytest.approx(75.0)
    # T=4 before t=2: weights 1/2, 1/3, 1/4 -> 1/2 / (13/12) = 6/13 of the rest
    assert budget_share(130.0, 2, 4) == pytest.approx(60.0)
