"""Timing one configuration: warm-up, then repeat until the mean is known well enough.

The stop rule (burn-in, then timed repeats, as in nanoGPT's benchmark):

1. Warm-up: call until at least `warmup_calls` calls *and* `warmup_s` seconds
   are spent, but never more than `warmup_share` of the point budget (after
   the first call, which always runs: it builds oneDNN primitives, and a
   TorchScript graph specialises on the new shape during its first calls).
2. Measure: call repeatedly, timing each call with perf_counter_ns. Stop as
   soon as `count >= min_count` and the half-width of the Student-t `confidence`
   interval of the mean is at most `rel_ci` x mean (converged), or when the
   per-point budget (or the caller's deadline) is spent, or at `max_count`.
   At least one timed call is made once warm-up finished, so a point whose single
   call exceeds the budget still gets a (flagged, unconverged) measurement.

`measure()` takes the clock as a parameter so tests can drive it with fake time.
"""

from __future__ import annotations

import math
import time
from functools import lru_cache
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats as _sps


@dataclass(frozen=True)
class StopRule:
    rel_ci: float = 0.05  # CI half-width must be within 5 % of the mean
    confidence: float = 0.95  # two-sided confidence of that interval
    min_count: int = 5  # fewer samples give a CI too wide to trust either way
    max_count: int = 5000  # a hard cap for very fast, noisy points
    point_budget_s: float = 10.0  # measurement + warm-up time for one (threads, batch)
    warmup_calls: int = 2
    warmup_s: float = 0.5
    warmup_share: float = 0.25  # warm-up never eats more than this share of the budget

    def __post_init__(self) -> None:
        if not 0 < self.rel_ci < 1 or not 0 < self.confidence < 1:
            raise ValueError("rel_ci and confidence must lie in (0, 1)")
        if self.min_count < 2 or self.max_count < self.min_count:
            raise ValueError("need 2 <= min_count <= max_count")
        if self.point_budget_s <= 0:
            raise ValueError("point budget must be positive")


@dataclass(frozen=True)
class PointStats:
    mean_ms: float
    p50_ms: float
    p99_ms: float
    std_ms: float | None  # None with a single sample
    count: int
    ci_half_width_ms: float | None
    converged: bool
    warmup_calls: int
    elapsed_s: float  # warm-up + measurement wall time


@lru_cache(maxsize=4096)
def _t_quantile(confidence: float, dof: int) -> float:
    return float(_sps.t.ppf(0.5 + confidence / 2, dof))


def ci_half_width(samples: list[float], confidence: float = 0.95) -> float:
    """Half-width of the two-sided Student-t CI of the mean; inf below two samples."""
    n = len(samples)
    if n < 2:
        return math.inf
    std = float(np.std(samples, ddof=1))
    return _t_quantile(confidence, n - 1) * std / math.sqrt(n)


def is_converged(samples: list[float], rule: StopRule) -> bool:
    if len(samples) < rule.min_count:
        return False
    mean = float(np.mean(samples))
    return ci_half_width(samples, rule.confidence) <= rule.rel_ci * mean


class _Running:
    """Welford's running mean/variance: the stop rule is checked after every sample,
    and recomputing over all samples would make fast points quadratic."""

    def __init__(self) -> None:
        self.n, self.mean, self._m2 = 0, 0.0, 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self._m2 += delta * (x - self.mean)

    def converged(self, rule: StopRule) -> bool:
        if self.n < rule.min_count:
            return False
        std = math.sqrt(self._m2 / (self.n - 1))
        return _t_quantile(rule.confidence, self.n - 1) * std / math.sqrt(self.n) <= rule.rel_ci * self.mean


def summarize(samples_ms: list[float], rule: StopRule, warmup_calls: int, elapsed_s: float) -> PointStats:
    arr = np.asarray(samples_ms, dtype=float)
    n = len(arr)
    half = ci_half_width(samples_ms, rule.confidence)
    return PointStats(
        mean_ms=float(arr.mean()),
        p50_ms=float(np.percentile(arr, 50)),
        p99_ms=float(np.percentile(arr, 99)),
        std_ms=float(arr.std(ddof=1)) if n > 1 else None,
        count=n,
        ci_half_width_ms=None if math.isinf(half) else half,
        converged=is_converged(samples_ms, rule),
        warmup_calls=warmup_calls,
        elapsed_s=elapsed_s,
    )


def measure(
    call: Callable[[], object],
    rule: StopRule,
    deadline: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> PointStats | None:
    """Warm up and time `call()` under `rule`. `deadline` is a `clock()` value.

    Returns None when the deadline leaves no time for a single timed call after
    warm-up: that point is then reported as omitted, never guessed.
    """
    start = clock()
    stop_at = start + rule.point_budget_s
    if deadline is not None:
        stop_at = min(stop_at, deadline)
    warmup_until = start + rule.warmup_share * (stop_at - start)

    warmups = 0
    while True:
        call()
        warmups += 1
        now = clock()
        if now >= warmup_until:
            break
        if warmups >= rule.warmup_calls and now - start >= rule.warmup_s:
            break
    if deadline is not None and clock() >= deadline:
        return None  # the total budget ran out during warm-up

    samples: list[float] = []
    running = _Running()
    while True:
        t0 = clock()
        call()
        samples.append((clock() - t0) * 1000.0)
        running.add(samples[-1])
        if running.converged(rule) or running.n >= rule.max_count or clock() >= stop_at:
            break
    return summarize(samples, rule, warmups, clock() - start)
