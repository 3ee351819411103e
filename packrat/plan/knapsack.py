"""Exact min–max 2-D knapsack: which thin instances to run for batch B on T cores.

Problem (docs/optimizer.md, "Formulation"): choose a multiset of instances
(t_i, b_i), each a profiled point of L(t, b), with Σ t_i ≤ T and Σ b_i = B,
minimising max_i L(t_i, b_i).
Batch sizes that were not profiled are reached by composition (24 = 16 + 8).

The table F[t, b] = least max-latency with at most t threads and total batch
exactly b satisfies

    F[t, 0] = -inf                       (the empty plan)
    F[t, b] = min over profiled (t', b') with t' ≤ t, b' ≤ b of
              max(L(t', b'), F[t - t', b - b'])

Row t only reads rows < t (t' ≥ 1), so a whole row is computed at once with
numpy: for each profiled batch b' the candidates of all t' form one 2-D array
(t' × b) whose min along t' is taken. That is T × (#batch sizes) numpy calls.

Ties. Many plans share the optimal max latency L*, since only the slowest
instance sets it. The rule, applied in order (each step exact, by its own DP):
  1. max latency ≤ L*·(1 + rtol)            (rtol = 0 by default: exact ties;
                                             max/min do no arithmetic, so
                                             equal means bit-equal)
  2. the largest minimum instance latency m* — instances as similar in
     latency as possible (the paper's preference): no instance is given
     cores or a batch that make it finish well before the slowest one;
     with rtol > 0, min latency ≥ m*·(1 - rtol) counts as a tie
  3. the fewest instances (fewer processes, less memory, less to swap)
  4. the fewest threads in total (spare cores stay free)
  5. the lexicographically largest list of (threads, batch), sorted
     descending (a fixed order so the same input always gives the same plan)
With cover=True the batch constraint is Σ b_i ≥ B (an instance may get a short
batch, costed at its full b_i), and after rule 4 the smallest Σ b_i wins. This
is what TorchServe does with ⌈B / b⌉ workers, and it has a plan for every B
that fits (on 2 cores, B = 7 has no exact plan from power-of-two batches).
The result is cached per (profile, T, B, rtol, cover): Profile is frozen and
hashes its points (not its `extra`), so the sizes the plan's prediction is for (the
profile's timed sizes, in `extra`) are set on the way out.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from packrat.errors import ConfigError, PlanError, ProfileError
from packrat.plan.confidence import fat_unless_distinct
from packrat.types import Instance, Plan, Profile, profile_sizes

__all__ = [
    "optimal_plan",
    "realizable_plan",
    "fat_latency",
    "realizable_gap",
    "LatencyTable",
    "latency_table",
]


@dataclass(frozen=True)
class LatencyTable:
    """The profile as a dense matrix restricted to threads ≤ T and batches ≤ B.

    `lat[t, j]` is L(t, batches[j]) in ms, +inf where not profiled; row 0 is unused.
    """

    lat: np.ndarray
    batches: tuple[int, ...]


def _check_args(cores: int, batch: int) -> tuple[int, int]:
    """Both as plain positive ints (numpy integers accepted, bools and floats not)."""
    out = []
    for name, value in (("cores", cores), ("batch", batch)):
        try:
            number = operator.index(value)
        except TypeError:
            number = None
        if number is None or isinstance(value, bool) or number <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        out.append(int(number))
    return out[0], out[1]


def latency_table(profile: Profile, cores: int, max_batch: int) -> LatencyTable:
    """Dense L(t, b) for 1 ≤ t ≤ cores and profiled b ≤ max_batch.

    Raises ProfileError if no point has threads ≤ cores (nothing could run).
    Duplicate points: the first wins, as in Profile.latency().
    """
    usable = [p for p in profile.points if 1 <= p.threads <= cores and p.batch >= 1]
    if not usable:
        raise ProfileError(
            f"profile {profile.model_id!r} has no point with threads <= {cores}"
        )
    batches = sorted({p.batch for p in usable if p.batch <= max_batch})
    col = {b: j for j, b in enumerate(batches)}
    lat = np.full((cores + 1, len(batches)), np.inf)
    seen: set[tuple[int, int]] = set()
    for p in usable:
        if p.batch > max_batch or (p.threads, p.batch) in seen:
            continue
        seen.add((p.threads, p.batch))
        if not (math.isfinite(p.mean_ms) and p.mean_ms > 0):
            raise ProfileError(
                f"profile {profile.model_id!r}: latency at threads={p.threads}, "
                f"batch={p.batch} is {p.mean_ms!r}, not a positive number"
            )
        lat[p.threads, col[p.batch]] = float(p.mean_ms)
    lat.setflags(write=False)
    return LatencyTable(lat=lat, batches=tuple(batches))


def _table(
    weight: np.ndarray,
    batches: tuple[int, ...],
    cores: int,
    top: int,
    combine: np.ufunc,
    pick: np.ufunc,
    empty: float,
    none: float,
) -> np.ndarray:
    """Generic DP over (threads budget, exact batch 0..top).

    F[t, 0] = empty; F[t, b] = pick over types (t', b') of combine(w(t', b'), F[t-t', b-b']).
    `weight` holds `none` for types that may not be used; `none` must absorb under
    `combine` and lose under `pick` (inf for min-max and additive, -inf for max-min).
    """
    F = np.full((cores + 1, top + 1), none)
    F[:, 0] = empty
    for t in range(1, cores + 1):
        row = F[t]
        for j, bj in enumerate(batches):
            # t' = t, t-1, ..., 1 pairs with sub-row r = t - t' = 0, 1, ..., t-1
            w = weight[t:0:-1, j]
            ok = w != none
            if not ok.any():
                continue
            if bj > top:
                continue
            width = top + 1 - bj
            if ok.all():
                sub = F[:t, :width]
            else:
                rows = np.flatnonzero(ok)
                w = w[rows]
                sub = F[rows, :width]
            cand = pick.reduce(combine(w[:, None], sub), axis=0)
            pick(row[bj:], cand, out=row[bj:])
    return F


@lru_cache(maxsize=256)
def _solve(profile: Profile, cores: int, batch: int, rtol: float, cover: bool) -> Plan:
    if cover:
        # A plan that covers B and loses any instance no longer covers it, at
        # best, so Σb ≤ B - 1 + (largest batch): the tables need go no further.
        # Every rule prefers dropping a surplus instance (max and min do not
        # get worse, n and Σt fall), so only such plans can win.
        table = latency_table(profile, cores, max(p.batch for p in profile.points))
        top = batch - 1 + max(table.batches)
    else:
        table = latency_table(profile, cores, batch)
        top = batch
    lat = table.lat
    if not table.batches:
        raise PlanError(
            f"no profiled batch size <= {batch} at threads <= {cores}; "
            f"batch {batch} cannot be composed"
        )
    # 1. the optimum L* and the tie band above it
    F = _table(lat, table.batches, cores, top, np.maximum, np.minimum, -np.inf, np.inf)
    best = F[cores, batch:].min()
    if not math.isfinite(best):
        raise PlanError(
            f"batch {batch} cannot be composed from the profiled batch sizes "
            f"{list(table.batches)} within {cores} threads"
            + ("" if cover else " (covering plans may exist: cover=True / --cover)")
        )
    ceiling = best * (1.0 + rtol)
    # 2. among plans within the band, the largest minimum instance latency
    within = np.where(lat <= ceiling, lat, -np.inf)
    H = _table(within, table.batches, cores, top, np.minimum, np.maximum, np.inf, -np.inf)
    floor = H[cores, batch:].max() * (1.0 - rtol)
    # 3.+4. fewest instances, then fewest threads: an additive cost n*(T+1) + Σt,
    # exact in float64 (integers far below 2**53)
    allowed = np.isfinite(lat) & (lat <= ceiling) & (lat >= floor)
    tcol = np.arange(cores + 1, dtype=float)[:, None]
    cost = np.where(allowed, (cores + 1) + tcol, np.inf)
    G = _table(cost, table.batches, cores, top, np.add, np.minimum, 0.0, np.inf)
    # (cover) then the smallest total batch: the first b ≥ B reaching the least cost
    target = batch + int(np.argmin(G[cores, batch:]))
    # 5. walk back taking the largest (t', b') that keeps the cost optimal; the
    # first pick is the largest type in any optimal plan, so picks never increase
    # and the list is the lexicographically largest among equals.
    types = sorted(
        ((t, j) for t in range(1, cores + 1) for j in range(len(table.batches))
         if allowed[t, j]),
        key=lambda tj: (tj[0], table.batches[tj[1]]),
        reverse=True,
    )
    instances: list[Instance] = []
    t, b = cores, target
    while b > 0:
        for tt, j in types:
            bj = table.batches[j]
            if tt <= t and bj <= b and cost[tt, j] + G[t - tt, b - bj] == G[t, b]:
                instances.append(Instance(threads=tt, batch=bj, latency_ms=float(lat[tt, j])))
                t, b = t - tt, b - bj
                break
        else:  # pragma: no cover - G says a plan exists, so a step always matches
            raise AssertionError(f"plan reconstruction failed at t={t}, b={b}")
    instances.sort(key=lambda i: (i.threads, i.batch), reverse=True)
    return Plan(
        cores=cores,
        batch=batch,
        instances=tuple(instances),
        predicted_latency_ms=max(i.latency_ms for i in instances),
        fat_latency_ms=fat_latency(profile, cores, batch),
    )


def fat_latency(profile: Profile, cores: int, batch: int) -> float | None:
    """The baseline: one instance with all `cores` threads running the whole batch.

    L(cores, batch) if that point was profiled, else None (no guess is made).
    """
    return profile.latency(cores, batch)


def optimal_plan(
    profile: Profile, cores: int, batch: int, *, rtol: float = 0.0, cover: bool = False
) -> Plan:
    """The min–max plan for `batch` requests on `cores` cores (see module docstring).

    `rtol` widens the tie bands of rules 1 and 2 (0 = exact ties). `cover=True`
    solves Σ b_i ≥ B instead of = B: an instance may get a short batch, costed at
    its full b_i (an upper bound when latency grows with batch); ties then also
    prefer the smallest Σ b_i (after rule 4). Raises ConfigError for cores/batch
    ≤ 0, ProfileError if no point has threads ≤ cores, PlanError if no plan exists.
    """
    cores, batch = _check_args(cores, batch)
    if not (0.0 <= rtol < 1.0):
        raise ConfigError(f"rtol must be in [0, 1), got {rtol!r}")
    return _with_sizes(_solve(profile, cores, batch, float(rtol), bool(cover)), profile)


@lru_cache(maxsize=256)
def _solve_realizable(profile: Profile, cores: int, batch: int) -> Plan:
    # Any profiled batch size may be the cap: a cap above B just means one
    # worker with a short batch, as in the covering optimum. max(default=1): an empty
    # profile then reaches latency_table, which says what is missing (ProfileError).
    table = latency_table(profile, cores, max((p.batch for p in profile.points), default=1))
    best: tuple | None = None
    for j, cap in enumerate(table.batches):
        n = -(-batch // cap)  # ceil(B / b): fewer workers cannot take the load
        if n > cores:
            continue
        for t in range(1, cores // n + 1):
            latency = table.lat[t, j]
            if n > 1 and profile.corun and math.isfinite(latency):
                # n workers run at once: their co-run figure (Profile.instance_latency).
                latency = profile.instance_latency(t, cap, n) or latency
            if not math.isfinite(latency):
                continue
            # same order as the unconstrained rule: latency, (all instances are
            # alike, so rule 2 is moot) fewer instances, fewer threads
            key = (latency, n, n * t)
            if best is None or key < best[0]:
                best = (key, t, cap)
    if best is None:
        raise PlanError(
            f"no shared batch cap serves batch {batch} on {cores} cores: every "
            f"profiled cap b needs ceil({batch}/b) workers of >= 1 thread"
        )
    (latency, n, _), t, cap = best
    inst = Instance(threads=t, batch=cap, latency_ms=float(latency))
    return Plan(
        cores=cores,
        batch=batch,
        instances=(inst,) * n,
        predicted_latency_ms=float(latency),
        fat_latency_ms=fat_latency(profile, cores, batch),
    )


def realizable_plan(profile: Profile, cores: int, batch: int, *, noise_guard: bool = True) -> Plan:
    """The best plan TorchServe can run as one model version.

    All workers of a version share one `batch_size` cap b and the front end gives
    a batch of up to b to whichever worker is idle; it does not choose which
    worker gets a short batch, so each worker must be assumed to get a full b.
    So: n = ceil(B / b) workers, cap b any profiled batch size, threads t_i with
    Σ t_i ≤ T, latency max_i L(t_i, b). Since the workers' jobs are identical,
    the fewest threads that reach a latency are the same for all of them:
    a uniform plan (n × t threads) is optimal, and that is what is returned.
    Instances list the cap as their batch; Σ batch may exceed B.

    With `noise_guard` (the default) the plan is fat, one worker with every
    core, unless the profile shows the plan faster than fat beyond the noise of
    the two figures (packrat.plan.confidence); False gives the plain minimum.
    """
    cores, batch = _check_args(cores, batch)
    plan = _with_sizes(_solve_realizable(profile, cores, batch), profile)
    return fat_unless_distinct(profile, plan) if noise_guard else plan


def _with_sizes(plan: Plan, profile: Profile) -> Plan:
    """`plan` saying the sizes `profile` was timed at. Set outside the caches: they key on
    the profile's points, and two profiles alike but timed at other sizes share an entry."""
    sizes = profile_sizes(profile)
    return plan if plan.sizes == sizes else replace(plan, sizes=sizes)  # the cached object when alike


def realizable_gap(optimal: Plan, realizable: Plan) -> float:
    """How much slower the realisable plan is predicted to be: 0.25 = 25 % slower."""
    return realizable.predicted_latency_ms / optimal.predicted_latency_ms - 1.0
