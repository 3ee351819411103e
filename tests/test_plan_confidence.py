"""The optimiser leaves fat only for a gain its profile can tell apart from noise
(packrat.plan.confidence), and says so through every path that plans."""

from __future__ import annotations

from packrat.plan import candidate_plans, plans_per_mode, realizable_plan
from packrat.plan.confidence import Figure, beats_fat, faster
from packrat.types import Fingerprint, Profile, ProfilePoint


def pt(t: int, b: int, ms: float, std: float | None, n: int | None, instances: int = 1) -> ProfilePoint:
    return ProfilePoint(t, b, ms, std_ms=std, count=n, instances=instances)


def shape(plan) -> list[tuple[int, int]]:
    return [(i.threads, i.batch) for i in plan.instances]


# GPT-2 fp32 on the 2-core EPYC (bench-out of the forked fp32 run, docs/benchmarks.md):
# mean, std and count of the points the B = 4 choice rests on. The plain optimum
# was one 1-thread worker, measured 0.83x fat.
GPT2 = Profile(
    model_id="gpt2",
    points=(pt(1, 1, 611.0, 70.8, 8), pt(1, 2, 1185.1, 100.3, 4), pt(1, 4, 1258.6, 153.4, 3),
            pt(2, 1, 685.1, 104.6, 8), pt(2, 2, 1085.3, 54.9, 4), pt(2, 4, 1408.7, 155.7, 4)),
    corun=(pt(1, 1, 798.8, 60.8, 6, instances=2), pt(1, 2, 1373.6, 120.0, 3, instances=2)),
)


def test_a_noisy_thin_optimum_gives_way_to_fat():
    assert shape(realizable_plan(GPT2, 2, 4, noise_guard=False)) == [(1, 4)]
    plan = realizable_plan(GPT2, 2, 4)
    assert shape(plan) == [(2, 4)]
    assert plan.predicted_latency_ms == 1408.7  # fat's own figure, not the thin one's


def test_a_clear_gain_is_kept():
    # B = 2: two co-run 1-thread workers at 799 +- 61 ms (6 calls) against fat's 1085 +- 55 (4).
    plan = realizable_plan(GPT2, 2, 2)
    assert shape(plan) == [(1, 1), (1, 1)]
    assert beats_fat(GPT2, plan) is True


def test_the_same_gap_with_tight_figures_is_kept():
    tight = Profile(model_id="tight", points=(pt(1, 4, 1258.6, 5.0, 10), pt(2, 4, 1408.7, 5.0, 10)))
    assert shape(realizable_plan(tight, 2, 4)) == [(1, 4)]


def test_single_call_figures_never_beat_fat():
    one = Profile(model_id="one", points=(pt(1, 4, 500.0, None, 1), pt(2, 4, 1400.0, 20.0, 5)))
    assert shape(realizable_plan(one, 2, 4)) == [(2, 4)]


def test_without_counts_or_fat_the_optimum_stands():
    # An external table (the paper's CSVs carry no counts) is taken as exact.
    exact = Profile(model_id="csv", points=(pt(1, 4, 1258.6, None, None), pt(2, 4, 1408.7, None, None)))
    assert shape(realizable_plan(exact, 2, 4)) == [(1, 4)]
    # Fat at this batch was not profiled: nothing to fall back to.
    no_fat = Profile(model_id="nofat", points=(pt(1, 4, 1258.6, 153.4, 3), pt(2, 2, 700.0, 9.0, 5)))
    assert shape(realizable_plan(no_fat, 2, 4)) == [(1, 4)]
    assert beats_fat(no_fat, realizable_plan(no_fat, 2, 4)) is None


def test_candidates_leave_out_what_fat_may_beat():
    cands = candidate_plans(GPT2, 2, 4)
    assert shape(cands[0]) == [(2, 4)]
    # The 1-thread worker at cap 4 and 2x(1t, b2) (co-run 1374 +- 120, 3 calls) are noise.
    assert all(beats_fat(GPT2, p) is not False for p in cands)
    assert [(1, 4)] not in [shape(p) for p in cands]


def test_the_mode_choice_plans_with_the_guard():
    fp = Fingerprint(cpu_model="x", usable_cores=2, allocator="glibc", torch_version="2",
                     mode="fp32-eager")
    prof = Profile(model_id="gpt2", points=GPT2.points, corun=GPT2.corun, fingerprint=fp)
    _, best = plans_per_mode([prof], 2, 4, realizable=True)
    assert best is not None and shape(best.plan) == [(2, 4)]


def test_welch_one_sided():
    assert faster(Figure(100.0, 1.0, 5), Figure(110.0, 1.0, 5))
    assert not faster(Figure(110.0, 1.0, 5), Figure(100.0, 1.0, 5))  # slower is never faster
    assert not faster(Figure(100.0, 30.0, 3), Figure(110.0, 30.0, 3))
    assert not faster(Figure(100.0, None, 1), Figure(500.0, 1.0, 5))
    assert faster(Figure(100.0, 0.0, 3), Figure(101.0, 0.0, 3))
