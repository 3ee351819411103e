"""Predicted latency of a plan at a batch it was not made for, and the
realisable alternatives the policy may choose from. Pure; no torch, no HTTP.

The policy compares the active plan against the plan for the newly estimated
B *at that B*, so it needs the active plan's latency at a load it was not
planned for. TorchServe hands a batch of up to the shared cap c to whichever
worker is idle (DESIGN.md), so, as packrat.plan.realizable_plan assumes, a
worker may get min(c, B) requests; B requests on n workers take
ceil(B / (n·c)) rounds:

    L_plan(B) = ceil(B / (n·c)) · max_i L(t_i, min(c, B))

At the plan's own batch this is the plan's predicted latency. A batch size
that was not profiled is read at the next profiled size above it (an upper
bound: latency grows with batch).
"""

from __future__ import annotations

import math

from packrat.types import Instance, Plan, Profile


def latency_at_or_above(profile: Profile, threads: int, batch: int) -> float | None:
    """L(threads, b) for the smallest profiled b ≥ batch; None if there is none."""
    best: tuple[int, float] | None = None
    for p in profile.points:
        if p.threads == threads and p.batch >= batch and (best is None or p.batch < best[0]):
            best = (p.batch, p.mean_ms)
    return None if best is None else best[1]


def plan_latency_at(profile: Profile, plan: Plan, batch: int) -> float | None:
    """Predicted time for `batch` concurrent requests on `plan`'s workers (ms).

    None when the profile lacks a point the prediction needs.
    """
    if not plan.instances or batch < 1:
        return None
    cap = max(i.batch for i in plan.instances)
    n = len(plan.instances)
    per_worker = min(cap, batch)
    rounds = math.ceil(batch / (n * cap))
    worst = 0.0
    for inst in plan.instances:
        lat = latency_at_or_above(profile, inst.threads, per_worker)
        if lat is None:
            return None
        worst = max(worst, lat)
    return rounds * worst


def uniform_candidates(profile: Profile, cores: int, batch: int) -> list[Plan]:
    """Every realisable uniform plan for `batch` on `cores`: n = ceil(B/c) workers
    of t threads with a profiled cap c ≤ B (the same space realizable_plan
    searches), each at its best thread count. Sorted by predicted latency.

    The policy scores these with its contention correction, which depends on
    the number of co-running workers and so can reorder them.
    """
    caps = sorted({p.batch for p in profile.points if p.batch <= batch})
    out: list[Plan] = []
    for cap in caps:
        n = -(-batch // cap)
        if n > cores:
            continue
        best: tuple[float, int] | None = None
        for t in range(1, cores // n + 1):
            lat = profile.latency(t, cap)
            if lat is not None and (best is None or lat < best[0]):
                best = (lat, t)
        if best is None:
            continue
        lat, t = best
        out.append(Plan(cores=cores, batch=batch,
                        instances=(Instance(threads=t, batch=cap, latency_ms=lat),) * n,
                        predicted_latency_ms=lat, fat_latency_ms=profile.latency(cores, batch)))
    out.sort(key=lambda p: (p.predicted_latency_ms, len(p.instances), p.threads_used))
    return out


def same_shape(a: Plan | None, b: Plan | None) -> bool:
    """Same workers (threads, cap) regardless of the batch the plan was made for."""
    if a is None or b is None:
        return False
    key = lambda p: sorted((i.threads, i.batch) for i in p.instances)  # noqa: E731
    return key(a) == key(b)
