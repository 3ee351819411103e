"""Leave fat only for a gain the profile can tell apart from its own noise.

The optimiser takes every profiled figure at face value. A slow model on a
short profiling budget has figures from three or four calls, each with a
95 % confidence interval of ±20–30 % (GPT-2 on 2 cores: L(1, 4) = 1259 ± 381 ms
against L(2, 4) = 1409 ± 248 ms), and picking the lower of two such figures
is a coin toss that can land on a plan slower than TorchServe's default, one
worker with every core ("fat"). Measured, that plan took 1324 ms against fat's
1094 ms (docs/benchmarks.md, the forked fp32 run).

So a plan other than fat is kept only when the profile says it is faster
than fat: Welch's one-sided t-test (unequal variances) of the plan's figure
against fat's, from each figure's mean, std and count, at the 5 % level
(scipy.stats.ttest_ind_from_stats). The plan's figure is the one that sets
its prediction, its slowest worker's: the co-run figure when its workers were
timed together, else the isolated one scaled by the co-run factor, spread
included. Otherwise fat is the plan. Where the test cannot be made, the
optimiser's plan stands:
  - fat was not profiled at this batch (nothing to fall back to);
  - a figure carries no count (an external table such as the paper's CSVs
    is taken as exact).
A figure from a single call has no spread to test with, so it never counts
as beating fat. Pure: no torch, no HTTP, no files.
"""

from __future__ import annotations

from dataclasses import dataclass

from packrat.types import Instance, Plan, Profile, ProfilePoint, profile_sizes

SIGNIFICANCE = 0.05


@dataclass(frozen=True)
class Figure:
    """A profiled mean with the spread and number of the calls behind it."""

    mean_ms: float
    std_ms: float | None  # None: a single call
    count: int


def _figure(point: ProfilePoint, scale: float = 1.0) -> Figure | None:
    if point.count is None:
        return None
    std = None if point.std_ms is None else point.std_ms * scale
    return Figure(point.mean_ms * scale, std, point.count)


def figure(profile: Profile, threads: int, batch: int, instances: int = 1) -> Figure | None:
    """The figure Profile.instance_latency gives for these arguments, with its spread.

    None: no such point, or a point without a count (an external table).
    """
    found = profile.instance_point(threads, batch, instances)
    return None if found is None else _figure(*found)


def faster(a: Figure, b: Figure) -> bool:
    """Whether a's mean is below b's at the 5 % level (Welch, one-sided)."""
    if a.std_ms is None or b.std_ms is None or a.count < 2 or b.count < 2:
        return False  # a single call has no spread to test with
    if a.std_ms == 0 and b.std_ms == 0:
        return a.mean_ms < b.mean_ms
    from scipy import stats  # slow to import; only needed for profiles with counts

    test = stats.ttest_ind_from_stats(a.mean_ms, a.std_ms, a.count, b.mean_ms, b.std_ms, b.count,
                                      equal_var=False, alternative="less")
    return bool(test.pvalue < SIGNIFICANCE)


def is_fat(plan: Plan) -> bool:
    """One worker with every core: TorchServe's default shape."""
    return len(plan.instances) == 1 and plan.instances[0].threads == plan.cores


def fat_plan(profile: Profile, cores: int, batch: int) -> Plan | None:
    """Fat at `batch` with its profiled figure; None when L(cores, batch) was not profiled."""
    lat = profile.latency(cores, batch)
    if lat is None:
        return None
    return Plan(cores=cores, batch=batch,
                instances=(Instance(threads=cores, batch=batch, latency_ms=float(lat)),),
                predicted_latency_ms=float(lat), fat_latency_ms=float(lat), sizes=profile_sizes(profile))


def beats_fat(profile: Profile, plan: Plan) -> bool | None:
    """Whether the profile shows `plan` faster than fat at the plan's batch (see the
    module doc). None when the test cannot be made (fat not profiled, or a
    figure without a count); True for fat itself."""
    if is_fat(plan):
        return True
    slowest = max(plan.instances, key=lambda i: i.latency_ms)
    mine = figure(profile, slowest.threads, slowest.batch, len(plan.instances))
    fat = figure(profile, plan.cores, plan.batch, 1)
    if mine is None or fat is None:
        return None
    return faster(mine, fat)


def fat_unless_distinct(profile: Profile, plan: Plan) -> Plan:
    """`plan`, or fat at its batch when the profile cannot tell the plan faster than fat."""
    if beats_fat(profile, plan) is not False:
        return plan
    fat = fat_plan(profile, plan.cores, plan.batch)
    return plan if fat is None else fat


__all__ = ["Figure", "beats_fat", "fat_plan", "fat_unless_distinct", "faster", "figure", "is_fat"]
