"""Candidate plans besides the optimiser's, and a plan's latency at a batch it
was not made for. Pure; no torch, no HTTP. The one place uniform plans are
built: the re-plan policy (packrat.observe.loop) and the bench (packrat.bench.run)
both take theirs from here.

    uniform_plan(n, threads, cap, cores, batch, profile)  n alike workers, with the profile's prediction
    uniform_candidates(profile, cores, batch)             the policy's alternatives: profiled caps, best t
    every_uniform_plan(cores, batch, profile)             the bench's oracle: ⟨i, ⌊T/i⌋, ⌈B/i⌉⟩ for every i
    candidate_plans(profile, cores, batch)                the optimiser's realisable plan, then uniform_candidates
    plan_from_shape(shape, cores, profile)                an explicit plan, predicted where profiled
    plan_latency_at(profile, plan, batch)                 the active plan scored at another B

The policy compares the active plan against the plan for the newly estimated
B *at that B*, so it needs the active plan's latency at a load it was not
planned for. TorchServe's front end hands a batch of up to the shared cap c
to whichever worker is idle (docs/live-plans.md), so, as
packrat.plan.realizable_plan assumes, a worker may get min(c, B) requests;
B requests on n workers take ceil(B / (n·c)) rounds:

    L_plan(B) = ceil(B / (n·c)) · max_i L(t_i, min(c, B))

At the plan's own batch this is the plan's predicted latency. A batch size
that was not profiled is read at the next profiled size above it (an upper
bound: latency grows with batch).
"""

from __future__ import annotations

import math

from collections.abc import Sequence

from packrat.errors import ConfigError, PlanError
from packrat.plan.confidence import beats_fat
from packrat.plan.knapsack import realizable_plan
from packrat.types import Instance, Plan, Profile, profile_sizes


def latency_at_or_above(profile: Profile, threads: int, batch: int, instances: int = 1) -> float | None:
    """L(threads, b) for the smallest profiled b ≥ batch, as one of `instances` running
    at once (Profile.instance_latency); None if there is none."""
    best: int | None = None
    for p in profile.points:
        if p.threads == threads and p.batch >= batch and (best is None or p.batch < best):
            best = p.batch
    return None if best is None else profile.instance_latency(threads, best, instances)


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
        lat = latency_at_or_above(profile, inst.threads, per_worker, n)
        if lat is None:
            return None
        worst = max(worst, lat)
    return rounds * worst


def uniform_plan(n: int, threads: int, cap: int, cores: int, batch: int, profile: Profile | None) -> Plan:
    """n workers of `threads` threads and batch cap `cap`, with the profile's prediction
    (0.0, "not predicted", where the profile lacks the point or there is none)."""
    lat = profile.instance_latency(threads, cap, n) if profile else None
    return Plan(
        cores=cores,
        batch=batch,
        instances=(Instance(threads=threads, batch=cap, latency_ms=float(lat or 0.0)),) * n,
        predicted_latency_ms=float(lat or 0.0),
        fat_latency_ms=profile.latency(cores, batch) if profile else None,
        sizes=profile_sizes(profile),
    )


def plan_from_shape(shape: Sequence[tuple[int, int]], cores: int, profile: Profile | None) -> Plan:
    """An explicit plan of (threads, batch cap) workers for `cores` cores.

    Its batch is Σ caps. Each worker is predicted from the profile when every
    worker's point is profiled; otherwise nothing is (0.0: "not predicted").
    """
    if not shape:
        raise ConfigError("a plan needs at least one instance")
    if len({cap for _, cap in shape}) > 1:
        raise ConfigError("all instances of a plan share one batch cap in TorchServe")
    lats = [profile.instance_latency(t, cap, len(shape)) if profile else None for t, cap in shape]
    known = all(x is not None for x in lats)
    inst = tuple(Instance(t, cap, float(x) if known else 0.0) for (t, cap), x in zip(shape, lats))
    return Plan(
        cores=cores,
        batch=sum(i.batch for i in inst),
        instances=tuple(sorted(inst, key=lambda i: (-i.threads, -i.batch))),
        predicted_latency_ms=max(i.latency_ms for i in inst) if known else 0.0,
        sizes=profile_sizes(profile) if known else (),
    )


def every_uniform_plan(cores: int, batch: int, profile: Profile | None) -> list[Plan]:
    """Every realisable uniform shape ⟨i, ⌊T/i⌋, ⌈B/i⌉⟩ for i = 1..min(T, B), fat (i = 1) first.

    What the bench measures as its oracle, profiled or not: one TorchServe
    version has one batch cap, so a realisable mix differs only in thread
    counts; with T = 2 every split is even and these are all there is. Σ caps
    may exceed B when i does not divide B (the front end decides which worker
    gets the short batch).
    """
    return [uniform_plan(i, cores // i, math.ceil(batch / i), cores, batch, profile)
            for i in range(1, min(cores, batch) + 1)]


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
            lat = profile.instance_latency(t, cap, n)
            if lat is not None and (best is None or lat < best[0]):
                best = (lat, t)
        if best is None:
            continue
        out.append(uniform_plan(n, best[1], cap, cores, batch, profile))
    out.sort(key=lambda p: (p.predicted_latency_ms, len(p.instances), p.threads_used))
    return out


def candidate_plans(profile: Profile, cores: int, batch: int) -> tuple[Plan, ...]:
    """What the re-plan policy chooses from: the optimiser's realisable plan first,
    then the other uniform plans (its contention correction may prefer one).
    Alternatives the profile cannot tell faster than fat are left out, as the
    optimiser's own choice is (packrat.plan.confidence)."""
    out: list[Plan] = []
    try:
        out.append(realizable_plan(profile, cores, batch))
    except PlanError:
        pass  # no realisable plan at this B from this profile: alternatives only
    for p in uniform_candidates(profile, cores, batch):
        if beats_fat(profile, p) is False:
            continue
        if not any(same_shape(p, q) for q in out):
            out.append(p)
    return tuple(out)


def same_shape(a: Plan | None, b: Plan | None) -> bool:
    """Same workers (threads, cap) in the same execution mode, regardless of the batch
    the plan was made for. A plan without a mode (the base archive's) matches any mode:
    the caller resolves modes when it compares across them."""
    if a is None or b is None or a.shape != b.shape:
        return False
    return a.mode is None or b.mode is None or a.mode == b.mode
