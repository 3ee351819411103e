"""The optimiser against brute-force enumeration, plus worked tie-break examples."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from packrat.errors import ConfigError, PlanError, ProfileError
from packrat.plan import optimal_plan, realizable_gap, realizable_plan
from packrat.types import Profile, ProfilePoint


def make_profile(table: dict[tuple[int, int], float], name: str = "p") -> Profile:
    return Profile(
        model_id=name,
        points=tuple(ProfilePoint(t, b, ms) for (t, b), ms in sorted(table.items())),
    )


def as_tuples(plan) -> list[tuple[int, int, float]]:
    return [(i.threads, i.batch, i.latency_ms) for i in plan.instances]


# ---------------------------------------------------------------- brute force

def all_plans(table, cores, batch):
    """Every multiset of profiled instances with Σt ≤ cores and Σb = batch."""
    types = sorted(((t, b, ms) for (t, b), ms in table.items() if t <= cores and b <= batch),
                   reverse=True)
    out = []

    def rec(start, t_left, b_left, chosen):
        if b_left == 0:
            out.append(list(chosen))
            return
        for k in range(start, len(types)):
            t, b, ms = types[k]
            if t <= t_left and b <= b_left:
                chosen.append(types[k])
                rec(k, t_left - t, b_left - b, chosen)
                chosen.pop()

    rec(0, cores, batch, [])
    return out


def all_covers(table, cores, batch):
    """Every multiset with Σt ≤ cores and Σb ≥ batch (finite: each instance takes a thread)."""
    top = cores * max(b for (_, b) in table)
    return [p for total in range(batch, top + 1) for p in all_plans(table, cores, total)]


def brute_best(table, cores, batch, rtol=0.0, cover=False):
    """The documented rule, applied literally to the list of all plans."""
    plans = all_covers(table, cores, batch) if cover else all_plans(table, cores, batch)
    if not plans:
        return None
    best = min(max(ms for _, _, ms in p) for p in plans)
    band = [p for p in plans if max(ms for _, _, ms in p) <= best * (1 + rtol)]
    floor = max(min(ms for _, _, ms in p) for p in band) * (1 - rtol)
    band = [p for p in band if min(ms for _, _, ms in p) >= floor]

    def key(p):
        desc = sorted(p, reverse=True)
        # fewest instances, fewest threads, smallest Σb (only varies with cover),
        # then the largest descending (t, b) list
        return (len(p), sum(t for t, _, _ in p), sum(b for _, b, _ in p),
                [(-t, -b) for t, b, _ in desc])

    return sorted(min(band, key=key), reverse=True)


def brute_realizable(table, cores, batch):
    """Least max latency over any shared cap b and any thread mix, ceil(B/b) workers."""
    best = math.inf
    for cap in {b for (_, b) in table}:
        n = -(-batch // cap)
        threads = sorted(t for (t, b) in table if b == cap)

        def rec(k, t_left, worst):
            nonlocal best
            if k == n:
                best = min(best, worst)
                return
            for t in threads:
                if t <= t_left:
                    rec(k + 1, t_left - t, max(worst, table[(t, cap)]))

        rec(0, cores, -math.inf)
    return None if best == math.inf else best


# ---------------------------------------------------------------- strategies

# Few distinct values make many exact ties; floats make noisy, non-monotone profiles.
latency = st.one_of(st.integers(1, 6).map(float),
                    st.floats(0.5, 100.0, allow_nan=False, allow_infinity=False))
profile_tables = st.dictionaries(
    keys=st.tuples(st.integers(1, 4), st.sampled_from([1, 2, 3, 4, 8])),
    values=latency,
    min_size=1,
    max_size=14,
)
fast = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@fast
@given(table=profile_tables, cores=st.integers(1, 5), batch=st.integers(1, 10))
def test_matches_brute_force(table, cores, batch):
    profile = make_profile(table)
    if not any(t <= cores for (t, _) in table):
        with pytest.raises(ProfileError):
            optimal_plan(profile, cores, batch)
        return
    expected = brute_best(table, cores, batch)
    if expected is None:
        with pytest.raises(PlanError):
            optimal_plan(profile, cores, batch)
        return
    plan = optimal_plan(profile, cores, batch)
    assert as_tuples(plan) == expected
    # the plan is feasible and its numbers are the profile's
    assert sum(i.threads for i in plan.instances) <= cores
    assert sum(i.batch for i in plan.instances) == batch
    assert plan.predicted_latency_ms == max(ms for _, _, ms in expected)
    for i in plan.instances:
        assert profile.latency(i.threads, i.batch) == i.latency_ms
    assert plan.fat_latency_ms == table.get((cores, batch))


@settings(max_examples=150, deadline=None)
@given(table=profile_tables, cores=st.integers(1, 5), batch=st.integers(1, 10),
       rtol=st.sampled_from([1e-3, 0.05, 0.3]))
def test_tolerance_bands_match_brute_force(table, cores, batch, rtol):
    assume(any(t <= cores for (t, _) in table))
    expected = brute_best(table, cores, batch, rtol)
    assume(expected is not None)
    plan = optimal_plan(make_profile(table), cores, batch, rtol=rtol)
    assert as_tuples(plan) == expected
    exact = optimal_plan(make_profile(table), cores, batch)
    assert exact.predicted_latency_ms <= plan.predicted_latency_ms
    assert plan.predicted_latency_ms <= exact.predicted_latency_ms * (1 + rtol)


@fast
@given(table=profile_tables, cores=st.integers(1, 4), batch=st.integers(1, 10))
def test_cover_matches_brute_force(table, cores, batch):
    assume(any(t <= cores for (t, _) in table))
    profile = make_profile(table)
    expected = brute_best(table, cores, batch, cover=True)
    if expected is None:
        with pytest.raises(PlanError):
            optimal_plan(profile, cores, batch, cover=True)
        return
    plan = optimal_plan(profile, cores, batch, cover=True)
    assert as_tuples(plan) == expected
    assert sum(i.batch for i in plan.instances) >= batch
    # covering relaxes Σb = B, so it is never slower than an exact plan...
    exact = brute_best(table, cores, batch)
    if exact is not None:
        assert plan.predicted_latency_ms <= max(ms for _, _, ms in exact)
    # ...and a realisable plan is a covering plan, so never faster than it
    try:
        real = realizable_plan(profile, cores, batch)
    except PlanError:
        return
    assert plan.predicted_latency_ms <= real.predicted_latency_ms


@fast
@given(table=profile_tables, cores=st.integers(1, 5), batch=st.integers(1, 10),
       seed=st.integers(0, 2**16))
def test_point_order_does_not_matter(table, cores, batch, seed):
    assume(brute_best(table, cores, batch) is not None)
    items = list(table.items())
    random.Random(seed).shuffle(items)
    shuffled = Profile("p", tuple(ProfilePoint(t, b, ms) for (t, b), ms in items))
    assert optimal_plan(shuffled, cores, batch) == optimal_plan(make_profile(table), cores, batch)


@fast
@given(table=profile_tables, cores=st.integers(1, 5), batch=st.integers(1, 10))
def test_realizable_matches_brute_force(table, cores, batch):
    assume(any(t <= cores for (t, _) in table))
    profile = make_profile(table)
    expected = brute_realizable(table, cores, batch)
    if expected is None:
        with pytest.raises(PlanError):
            realizable_plan(profile, cores, batch)
        return
    plan = realizable_plan(profile, cores, batch)
    assert plan.realizable
    assert plan.predicted_latency_ms == expected
    cap = plan.instances[0].batch
    assert len(plan.instances) == -(-batch // cap)  # ceil(B / cap) workers
    assert plan.threads_used <= cores
    assert all(profile.latency(i.threads, i.batch) == i.latency_ms for i in plan.instances)
    # A realisable plan whose caps add up to B exactly is a plan of the
    # unconstrained problem too, so it cannot beat the optimum.
    if len(plan.instances) * cap == batch:
        assert optimal_plan(profile, cores, batch).predicted_latency_ms <= expected


# ---------------------------------------------------------------- worked examples

def test_rule2_similar_latencies_beat_fewer_instances():
    # T=3, B=3. L(1,1)=10, L(2,2)=4 (no (1,2), (1,3), (3,3) points).
    # 3 x (1,1): max 10, min 10.  (2,2)+(1,1): max 10, min 4.
    # Both have max 10; rule 2 (largest min) picks 3 x (1,1) despite more instances.
    plan = optimal_plan(make_profile({(1, 1): 10.0, (2, 2): 4.0}), 3, 3)
    assert as_tuples(plan) == [(1, 1, 10.0)] * 3


def test_rule3_fewest_instances():
    # T=2, B=2. L(2,2)=10, L(1,1)=10: one instance (2,2) or two (1,1), both max=min=10.
    plan = optimal_plan(make_profile({(1, 1): 10.0, (2, 2): 10.0, (2, 1): 6.0}), 2, 2)
    assert as_tuples(plan) == [(2, 2, 10.0)]


def test_rule4_fewest_threads():
    # T=4, B=2. L(1,2)=L(2,2)=10: one instance either way; 1 thread leaves 3 cores free.
    plan = optimal_plan(make_profile({(1, 2): 10.0, (2, 2): 10.0}), 4, 2)
    assert as_tuples(plan) == [(1, 2, 10.0)]


def test_rule5_largest_descending_list():
    # T=4, B=2, every point 10 ms. Plans with 2 instances and 4 threads:
    # [(3,1),(1,1)] and [(2,1),(2,1)]; but 1 instance (t,2) is absent, and fewer
    # threads: [(1,1),(1,1)] uses 2 threads, so rule 4 picks it.
    table = {(1, 1): 10.0, (2, 1): 10.0, (3, 1): 10.0}
    assert as_tuples(optimal_plan(make_profile(table), 4, 2)) == [(1, 1, 10.0)] * 2
    # Without (1,1): [(3,1),(?)] needs a 1-thread point, so only [(2,1),(2,1)] is left.
    table = {(2, 1): 10.0, (3, 1): 10.0}
    assert as_tuples(optimal_plan(make_profile(table), 4, 2)) == [(2, 1, 10.0)] * 2
    # Same n and threads, different lists: T=4, B=4 with points (3,1), (1,3), (2,2).
    # Σb=4 only as [(3,1),(1,3)] or [(2,2),(2,2)]: both 2 instances, 4 threads.
    # Descending lists compare at the first entry: (3,1) > (2,2).
    table = {(3, 1): 10.0, (1, 3): 10.0, (2, 2): 10.0}
    assert as_tuples(optimal_plan(make_profile(table), 4, 4)) == [(3, 1, 10.0), (1, 3, 10.0)]


def test_tolerance_merges_near_ties():
    # Exact: 2 x (1,1) at 10.0 beats (2,2) at 10.000001.
    table = {(1, 1): 10.0, (2, 2): 10.000001}
    assert as_tuples(optimal_plan(make_profile(table), 2, 2)) == [(1, 1, 10.0)] * 2
    # With rtol=1e-6 both are within 10.0 * (1 + 1e-6) = 10.00001: fewer instances wins.
    plan = optimal_plan(make_profile(table), 2, 2, rtol=1e-6)
    assert as_tuples(plan) == [(2, 2, 10.000001)]


def test_composition_beyond_profiled_batches():
    # B=24 unprofiled: 16 + 8. L(2,16)=50 and L(2,8)=30 on T=4; L(4,16)=40, L(4,8)=20.
    # Options: (2,16)+(2,8) -> 50; (4,16) can't add another instance (no threads left);
    # 3 x (1,8) is absent. So 50 ms, instances sorted by (threads, batch) descending.
    table = {(2, 16): 50.0, (2, 8): 30.0, (4, 16): 40.0, (4, 8): 20.0}
    plan = optimal_plan(make_profile(table), 4, 24)
    assert as_tuples(plan) == [(2, 16, 50.0), (2, 8, 30.0)]
    assert plan.fat_latency_ms is None and plan.expected_speedup is None
    # B=32 > largest profiled batch: 2 x (2,16) at 50 ms.
    assert as_tuples(optimal_plan(make_profile(table), 4, 32)) == [(2, 16, 50.0)] * 2
    # T=1 cannot run B=32 with a single instance: no plan.
    with pytest.raises(PlanError):
        optimal_plan(make_profile({(1, 16): 5.0}), 1, 32)


def test_fat_and_speedup():
    # T=2, B=2: fat L(2,2)=12; thin 2 x (1,1) at 8 -> 12/8 = 1.5x.
    plan = optimal_plan(make_profile({(2, 2): 12.0, (1, 1): 8.0, (2, 1): 7.0}), 2, 2)
    assert plan.fat_latency_ms == 12.0
    assert plan.expected_speedup == pytest.approx(12.0 / 8.0)


def test_cached_and_errors():
    profile = make_profile({(1, 1): 1.0})
    assert optimal_plan(profile, 3, 2) is optimal_plan(profile, 3, 2)
    for cores, batch in [(0, 1), (1, 0), (-1, 2)]:
        with pytest.raises(ConfigError):
            optimal_plan(profile, cores, batch)
    with pytest.raises(ProfileError):
        optimal_plan(make_profile({(4, 1): 1.0}), 2, 1)  # nothing fits in 2 cores
    with pytest.raises(PlanError):
        optimal_plan(make_profile({(1, 2): 1.0}), 4, 3)  # odd B from even batches


def test_realizable_uses_one_cap_and_reports_gap():
    table = {(3, 3): 7.0, (1, 1): 20.0, (2, 2): 8.0}
    # T=4, B=4: optimum 2 x (2,2) = 8 (vs (3,3)+(1,1) = 20, 4 x (1,1) = 20);
    # it shares cap 2, so the realisable plan is the same: gap 0.
    opt = optimal_plan(make_profile(table), 4, 4)
    real = realizable_plan(make_profile(table), 4, 4)
    assert as_tuples(opt) == as_tuples(real) == [(2, 2, 8.0)] * 2
    assert realizable_gap(opt, real) == 0.0
    # T=5, B=5: optimum (3,3)+(2,2) = max(7, 8) = 8 mixes caps 3 and 2.
    # Realisable: cap 3 -> ceil(5/3)=2 workers x 3 threads = 6 > 5 cores;
    # cap 2 -> 3 workers x 2 threads = 6 > 5; cap 1 -> 5 x (1,1) = 20 ms.
    # Gap 20/8 - 1 = 150 %.
    opt = optimal_plan(make_profile(table), 5, 5)
    real = realizable_plan(make_profile(table), 5, 5)
    assert as_tuples(opt) == [(3, 3, 7.0), (2, 2, 8.0)] and not opt.realizable
    assert as_tuples(real) == [(1, 1, 20.0)] * 5 and real.realizable
    assert realizable_gap(opt, real) == pytest.approx(20.0 / 8.0 - 1)
    # T=2, B=3 with cap 2 only: ceil(3/2)=2 workers of 1 thread, L(1,2)=4 ms; the
    # unconstrained problem has no plan (3 is not a sum of 2s).
    real = realizable_plan(make_profile({(1, 2): 4.0}), 2, 3)
    assert as_tuples(real) == [(1, 2, 4.0)] * 2
    with pytest.raises(PlanError):
        optimal_plan(make_profile({(1, 2): 4.0}), 2, 3)


def test_cover_plans_awkward_batches():
    # T=2, points (1,4)=23, (1,2)=13, (1,1)=8. B=7 exactly needs 4+2+1: 3 instances
    # on 2 threads -> no plan. Covering: (1,4)+(1,4) = 23 covers 8 >= 7; so does
    # (1,4)+(1,2)+... no (3 instances). Candidates with 2 instances and Σb >= 7:
    # only 4+4 -> 23 ms.
    table = {(1, 4): 23.0, (1, 2): 13.0, (1, 1): 8.0}
    with pytest.raises(PlanError):
        optimal_plan(make_profile(table), 2, 7)
    assert as_tuples(optimal_plan(make_profile(table), 2, 7, cover=True)) == [(1, 4, 23.0)] * 2
    # B=3: exact (1,2)+(1,1) = max(13, 8) = 13, min 8; covering 2 x (1,2) = 13,
    # min 13 -> rule 2 prefers the covering one (same max, more similar).
    assert as_tuples(optimal_plan(make_profile(table), 2, 3)) == [(1, 2, 13.0), (1, 1, 8.0)]
    assert as_tuples(optimal_plan(make_profile(table), 2, 3, cover=True)) == [(1, 2, 13.0)] * 2
    # B=1 covering: (1,1) = 8 (Σb = 1) beats (1,2) = 13.
    assert as_tuples(optimal_plan(make_profile(table), 2, 1, cover=True)) == [(1, 1, 8.0)]


def test_an_empty_profile_is_refused_with_a_clear_error() -> None:
    # A profile whose every point was omitted (a budget spent on a busy machine) says so,
    # instead of a bare max() of an empty sequence.
    from packrat.errors import ProfileError
    from packrat.plan import realizable_plan
    from packrat.types import Profile

    with pytest.raises(ProfileError, match="has no point"):
        realizable_plan(Profile(model_id="empty", points=()), 2, 2)
