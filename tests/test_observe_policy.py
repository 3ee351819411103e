"""The re-plan decision, driven tick by tick with an injected clock."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from packrat.observe.estimator import Estimate, EstimatorState
from packrat.observe.persist import (
    estimator_state_from_json,
    estimator_state_to_json,
    policy_state_from_json,
    policy_state_to_json,
)
from packrat.observe.policy import (
    Correction,
    PolicyContext,
    PolicySettings,
    PolicyState,
    decide,
    required_dwell_s,
    update_correction,
)
from packrat.types import Instance, Observation, Plan


def plan(batch: int, workers: int, threads: int, cap: int, ms: float) -> Plan:
    return Plan(cores=4, batch=batch, instances=(Instance(threads, cap, ms),) * workers,
                predicted_latency_ms=ms)


FAT8 = plan(8, 1, 4, 8, 100.0)  # one worker, 4 threads, cap 8
THIN8 = plan(8, 4, 1, 2, 80.0)  # four workers, 1 thread each, cap 2


def est(batch: int, t: float = 0.0, observed_ms: float | None = None, **kw) -> Estimate:
    # a steady estimate: raw window, EWMA and majority all read `batch`,
    # 100 requests over a 5 s window
    kw.setdefault("concurrency", float(batch))
    kw.setdefault("rounded", batch)
    kw.setdefault("request_rate", 20.0)
    kw.setdefault("span_s", 5.0)
    return Estimate(time_s=t, model="m", batch=batch, ready=kw.pop("ready", True),
                    mean_latency_ms=observed_ms, **kw)


def ctx(now: float, e: Estimate, current: Plan | None, current_ms: float | None,
        *candidates: Plan, **kw) -> PolicyContext:
    return PolicyContext(now_s=now, model="m", estimate=e, current=current,
                         current_latency_ms=current_ms, candidates=tuple(candidates), **kw)


# A state whose estimate has held B=8 since t=0 (past min_stable_s = 5 s at t >= 5).
STABLE8 = PolicyState(seen_batch=8, seen_since_s=0.0)


def test_gain_threshold() -> None:
    # gain = 100/95 - 1 = 0.0526 <= 0.10: stay
    d, _ = decide(STABLE8, ctx(10, est(8), FAT8, 100.0, plan(8, 4, 1, 2, 95.0)))
    assert (d.swap, d.reason) == (False, "gain-below-threshold")
    assert d.predicted_gain == pytest.approx(100 / 95 - 1)
    # gain = 100/80 - 1 = 0.25 > 0.10: swap to THIN8
    d, st = decide(STABLE8, ctx(10, est(8), FAT8, 100.0, THIN8))
    assert (d.swap, d.reason, d.target) == (True, "gain", THIN8)
    assert st.last_swap_s == 10 and st.swaps == 1


def test_threshold_is_configurable() -> None:
    # gain 0.25 is not above a 0.30 threshold
    d, _ = decide(STABLE8, ctx(10, est(8), FAT8, 100.0, THIN8,
                               settings=PolicySettings(gain_threshold=0.30)))
    assert (d.swap, d.reason) == (False, "gain-below-threshold")


def test_dwell_after_a_swap() -> None:
    # a gain just above the threshold waits about the whole min_dwell_s:
    # 100/90 - 1 = 0.111 -> dwell 60 · (0.10 / 0.111)² = 60 · 0.81 = 48.6 s
    near = plan(8, 4, 1, 2, 90.0)
    state = replace(STABLE8, last_swap_s=100.0)
    # 130 - 100 = 30 s < 48.6 s dwell
    d, _ = decide(state, ctx(130, est(8), FAT8, 100.0, near))
    assert (d.swap, d.reason) == (False, "dwell") and d.dwell_s == pytest.approx(48.6)
    # 161 - 100 = 61 s >= 48.6 s
    d, _ = decide(state, ctx(161, est(8), FAT8, 100.0, near))
    assert (d.swap, d.reason) == (True, "gain")
    # dwell also counts from when the controller says the plan came in
    d, _ = decide(STABLE8, ctx(161, est(8), FAT8, 100.0, near, active_since_s=150.0))
    assert d.reason == "dwell"  # 161 - 150 = 11 s < 48.6 s


def test_disabled_model_never_swaps() -> None:
    # Each case swaps when enabled (ready, settled estimate; a better plan), so only
    # the switch can be what stops it.
    assert decide(STABLE8, ctx(10, est(8), FAT8, 100.0, THIN8))[0].swap
    d, st = decide(STABLE8, ctx(10, est(8), FAT8, 100.0, THIN8, enabled=False))
    assert (d.swap, d.reason) == (False, "disabled")
    assert d.predicted_gain == pytest.approx(0.25)  # still computed and reported
    assert st.swaps == 0
    # even with no plan at all
    assert decide(STABLE8, ctx(10, est(8), None, None, THIN8))[0].reason == "no-active-plan"
    d, _ = decide(STABLE8, ctx(10, est(8), None, None, THIN8, enabled=False))
    assert (d.swap, d.reason) == (False, "disabled")


def test_never_while_a_swap_runs() -> None:
    d, _ = decide(STABLE8, ctx(10, est(8), FAT8, 100.0, THIN8, swap_in_progress=True))
    assert (d.swap, d.reason) == (False, "swap-in-progress")


def test_idle_and_warming_up_do_not_swap() -> None:
    d, _ = decide(STABLE8, ctx(10, est(8, idle=True), FAT8, 100.0, THIN8))
    assert (d.swap, d.reason) == (False, "idle")
    d, _ = decide(STABLE8, ctx(10, est(8, ready=False), FAT8, 100.0, THIN8))
    assert (d.swap, d.reason) == (False, "warming-up")


def test_estimate_must_hold_before_a_swap() -> None:
    fat4 = plan(4, 1, 4, 4, 60.0)
    # B was 4; at t=20 it reads 8 for the first time: settling, then 4.9 s later still settling
    state = PolicyState(seen_batch=4, seen_since_s=0.0)
    d, state = decide(state, ctx(20, est(8), fat4, 100.0, THIN8))
    assert (d.swap, d.reason, state.seen_since_s) == (False, "estimate-settling", 20)
    d, state = decide(state, ctx(24.9, est(8), fat4, 100.0, THIN8))
    assert d.reason == "estimate-settling" and d.estimate_stable_s == pytest.approx(4.9)
    # 25 - 20 = 5 s >= min_stable_s
    d, state = decide(state, ctx(25, est(8), fat4, 100.0, THIN8))
    assert (d.swap, d.reason) == (True, "gain")


def test_same_plan_and_initial_plan() -> None:
    d, _ = decide(STABLE8, ctx(10, est(8), THIN8, 80.0, THIN8))
    assert (d.swap, d.reason) == (False, "same-plan")
    # the first plan waits for B to hold too: first seen at 10 -> settling until 15
    d, st = decide(PolicyState(), ctx(10, est(8), None, None, THIN8))
    assert (d.swap, d.reason) == (False, "estimate-settling")
    d, _ = decide(st, ctx(15, est(8), None, None, THIN8))
    assert (d.swap, d.reason, d.target) == (True, "no-active-plan", THIN8)
    d, _ = decide(STABLE8, ctx(10, est(8), FAT8, 100.0))
    assert (d.swap, d.reason) == (False, "no-plan")


def test_correction_learns_the_gap_after_settling() -> None:
    # THIN8 (4 workers) runs at B=8, predicted 80 ms, observed 104 ms: ratio 1.3
    e = est(8, observed_ms=104.0)
    # a one-worker plan measured base 1.0 (10 ticks: trusted), so the gap is contention
    measured = Correction(base=1.0, base_samples=10)
    state = replace(STABLE8, last_swap_s=0.0, correction=measured)
    # t=10 < settle_s = 15 after the swap: not learned yet
    d, state = decide(state, ctx(10, e, THIN8, 80.0, THIN8))
    assert d.latency_gap is None and state.correction == measured
    d, state = decide(state, ctx(16, e, THIN8, 80.0, THIN8))
    assert d.latency_gap == pytest.approx(0.3)  # 104/80 - 1
    # base 1.0: per co-runner = (1.3/1.0 - 1)/(4 - 1) = 0.1
    assert state.correction.per_corunner == pytest.approx(0.1)
    assert state.correction.factor(4) == pytest.approx(1.3)  # 1·(1 + 0.1·3)
    assert state.correction.factor(1) == 1.0
    # a tick at another B than the plan's teaches nothing (prediction is for 8)
    _, s2 = decide(state, ctx(17, est(4, observed_ms=500.0), THIN8, 80.0, THIN8))
    assert s2.correction == state.correction
    # nor does a window with too few requests (2 req/s · 4 s = 8 < 10)
    _, s4 = decide(state, ctx(17, est(8, observed_ms=500.0, request_rate=2.0, span_s=4.0),
                              THIN8, 80.0, THIN8))
    assert s4.correction == state.correction
    # nor does a load step the smoothed B has not caught up with: B still reads 8
    # but the window says 12.5 (rounds to 16) and the latency is the new load's
    _, s3 = decide(state, ctx(18, est(8, observed_ms=400.0, concurrency=12.5, rounded=16),
                              THIN8, 80.0, THIN8))
    assert s3.correction == state.correction


def test_correction_uses_service_time_when_queue_time_is_known() -> None:
    # 104 ms end to end, of which 24 ms waiting in TorchServe's queue: 80 ms of
    # service against 80 predicted -> ratio 1.0, no contention booked
    e = est(8, observed_ms=104.0, mean_queue_ms=24.0)
    d, st = decide(STABLE8, ctx(16, e, THIN8, 80.0, THIN8))
    assert d.observed_ms == pytest.approx(80.0) and d.latency_gap == pytest.approx(0.0)
    assert st.correction.per_corunner == pytest.approx(0.0)


def test_correction_separates_shared_overhead_from_contention() -> None:
    s = PolicySettings(min_correction_samples=1)  # one one-worker tick trusts base
    c = update_correction(Correction(), 1.1, workers=1, settings=s)
    assert c.base == pytest.approx(1.1)  # first sample taken as is
    # a 4-worker plan at ratio 1.43: (1.43/1.1 - 1)/3 = 0.1 per co-runner
    c = update_correction(c, 1.43, workers=4, settings=s)
    assert c.per_corunner == pytest.approx(0.1)
    assert c.factor(4) == pytest.approx(1.43)  # 1.1·1.3
    # next sample EWMA(0.1): base 0.1·1.2 + 0.9·1.1 = 1.11
    c = update_correction(c, 1.2, workers=1, settings=s)
    assert c.base == pytest.approx(1.11)
    # ratios are clamped to [1/4, 4], per co-runner to [-0.25, 0.5]
    assert update_correction(Correction(), 100.0, 1, s).base == 4.0
    assert update_correction(Correction(base_samples=1), 3.0, 2, s).per_corunner == 0.5  # (3/1 - 1)/1 = 2 -> 0.5


def test_correction_is_used_only_once_measured_enough() -> None:
    c = Correction(base=1.2, per_corunner=0.3, base_samples=10, corunner_samples=9)
    # base has 10 samples: used; per co-runner has 9 < 10: not used
    assert c.factor(3, min_samples=10) == pytest.approx(1.2 * 1.0)
    assert c.factor(3) == pytest.approx(1.2 * 1.6)  # everything, when not asked to be picky
    # per co-runner is contention only against a measured base: with base at 9 samples
    # neither part is used, however often per co-runner was measured
    young_base = replace(c, base_samples=9, corunner_samples=10)
    assert young_base.factor(3, min_samples=10) == 1.0
    # so a young correction does not change the choice: profiles alone decide (swap)
    fat = plan(8, 1, 4, 8, 70.0)
    thin = plan(8, 4, 1, 2, 60.0)
    young = replace(STABLE8, correction=Correction(per_corunner=0.1, corunner_samples=9))
    d, _ = decide(young, ctx(10, est(8), fat, 70.0, thin))
    assert d.swap and not d.correction_changed_choice


def test_correction_turns_a_swap_into_no_swap() -> None:
    # fat 1 worker at 70 ms; thin 4 workers predicted 60 ms: raw gain 70/60-1 = 0.167 > 0.1
    fat = plan(8, 1, 4, 8, 70.0)
    thin = plan(8, 4, 1, 2, 60.0)
    state = replace(STABLE8, correction=Correction(per_corunner=0.1, base_samples=10,
                                                   corunner_samples=10))
    d, _ = decide(state, ctx(10, est(8), fat, 70.0, thin))
    # corrected: thin 60·1.3 = 78 ms, fat 70·1.0: gain 70/78 - 1 < 0
    assert d.predicted_gain == pytest.approx(70 / 60 - 1)
    assert d.corrected_gain == pytest.approx(70 / 78 - 1)
    assert (d.swap, d.reason, d.correction_changed_choice) == (False, "gain-below-threshold", True)
    # with use_correction off the profiles alone decide: swap
    d, _ = decide(state, ctx(10, est(8), fat, 70.0, thin,
                             settings=PolicySettings(use_correction=False)))
    assert d.swap and d.target == thin


def test_correction_picks_another_candidate() -> None:
    # THIN8 runs; B moves to 16. Active plan at 16: 2 rounds -> 160 ms predicted.
    thin16 = plan(16, 4, 1, 4, 90.0)
    fat16 = plan(16, 1, 4, 16, 100.0)
    state = PolicyState(seen_batch=16, seen_since_s=0.0,
                        correction=Correction(per_corunner=0.1, base_samples=10,
                                              corunner_samples=10))
    d, _ = decide(state, ctx(10, est(16), THIN8, 160.0, thin16, fat16))
    # profiles alone: thin16 (gain 160/90 - 1 = 0.78); corrected: thin16 90·1.3 = 117,
    # fat16 100·1.0 = 100 -> fat16, gain 160·1.3/100 - 1 = 1.08
    assert d.optimiser_choice == thin16 and d.target == fat16
    assert d.corrected_gain == pytest.approx(208 / 100 - 1)
    assert d.swap and d.correction_changed_choice


def test_decision_json_and_state_round_trip() -> None:
    d, st = decide(STABLE8, ctx(10, est(8, observed_ms=90.0), FAT8, 100.0, THIN8))
    line = json.dumps(d.to_dict())  # one structured log line
    back = json.loads(line)
    assert back["reason"] == "gain" and Plan.from_dict(back["target"]) == THIN8
    assert policy_state_from_json(json.loads(json.dumps(policy_state_to_json(st)))) == st
    es = EstimatorState(samples=(Observation(1.0, "m", 2.0, 3.0, 0.5, None),), ewma=2.5,
                        recent=(2, 4), batch=2, resets=1, voted=True, latency_ms=12.5)
    assert estimator_state_from_json(json.loads(json.dumps(estimator_state_to_json(es)))) == es
    # a restart in the middle of a step (one window departed) resumes it, and the swap
    # bound and the misplacement clock survive too
    mid = replace(es, step_dir=1, step_count=1, step_base=Observation(0.0, "m", 1.0, 2.0, None, 3))
    assert estimator_state_from_json(json.loads(json.dumps(estimator_state_to_json(mid)))) == mid
    ps = replace(st, swap_times=(3.0, 10.0), misplaced_since_s=4.0, seen_batch=0)
    assert policy_state_from_json(json.loads(json.dumps(policy_state_to_json(ps)))) == ps


def test_cores_moved_swaps_despite_dwell_and_no_gain() -> None:
    # The model's cores were divided anew: its plan runs outside them. It moves even
    # right after a swap (dwell) and to the same shape (no gain), once B has held and the
    # cores have been elsewhere for min_stable_s (5 s) too.
    just_swapped = replace(STABLE8, last_swap_s=9.0)
    same = plan(8, 1, 4, 8, 100.0)
    d, _ = decide(just_swapped, ctx(10, est(8), FAT8, 100.0, same))
    assert not d.swap and d.reason == "same-plan"
    # misplaced from t=10: 0 s, then 14.9 - 10 = 4.9 s < 5 s
    d, st = decide(just_swapped, ctx(10, est(8), FAT8, 100.0, same, misplaced=True))
    assert (d.swap, d.reason, st.misplaced_since_s) == (False, "cores-settling", 10)
    d, st = decide(st, ctx(14.9, est(8), FAT8, 100.0, same, misplaced=True))
    assert (d.swap, d.reason) == (False, "cores-settling")
    d, st = decide(st, ctx(15, est(8), FAT8, 100.0, same, misplaced=True))  # 5 s
    assert d.swap and d.reason == "cores-moved" and d.target == same
    # back inside its cores, the clock stops: a new misplacement starts it again
    _, st = decide(st, ctx(16, est(8), same, 100.0, same))
    assert st.misplaced_since_s is None
    # ... but not while B settles (even with the cores long elsewhere), nor while idle or
    # during a swap.
    settling = PolicyState(seen_batch=8, seen_since_s=8.0, misplaced_since_s=0.0)
    d, _ = decide(settling, ctx(10, est(8), FAT8, 100.0, same, misplaced=True))
    assert not d.swap and d.reason == "estimate-settling"
    d, _ = decide(STABLE8, ctx(10, est(8, idle=True), FAT8, 100.0, same, misplaced=True))
    assert not d.swap and d.reason == "idle"
    d, _ = decide(STABLE8, ctx(10, est(8), FAT8, 100.0, same, misplaced=True, swap_in_progress=True))
    assert not d.swap and d.reason == "swap-in-progress"


def test_the_dwell_shrinks_with_the_gain() -> None:
    s = PolicySettings()  # min_dwell_s 60, gain_threshold 0.10, dwell_power 2
    # dwell(gain) = 60 · (0.10 / gain)², at most 60
    assert required_dwell_s(0.10, s) == 60.0  # at the threshold: all of it
    assert required_dwell_s(0.20, s) == pytest.approx(15.0)  # 60 · 0.5²
    assert required_dwell_s(0.50, s) == pytest.approx(2.4)  # 1.5x faster: 60 · 0.2²
    # the BERT-base: 285 ms -> 106 ms predicted, gain 1.6887:
    # 60 · (0.1 / 1.6887)² = 60 · 0.003507 = 0.2104 s
    assert required_dwell_s(285 / 106 - 1, s) == pytest.approx(0.2104, abs=1e-4)
    assert required_dwell_s(None, s) == 60.0
    # power 0: every swap waits min_dwell_s, as before the rule existed
    assert required_dwell_s(1.7, PolicySettings(dwell_power=0.0)) == 60.0
    # no positive threshold to scale against: min_dwell_s
    assert required_dwell_s(0.5, PolicySettings(gain_threshold=0.0)) == 60.0
    # THIN8 against FAT8: gain 0.25 -> 60 · 0.4² = 9.6 s after the last swap at 100
    state = replace(STABLE8, last_swap_s=100.0)
    d, _ = decide(state, ctx(109, est(8), FAT8, 100.0, THIN8))
    assert (d.swap, d.reason) == (False, "dwell") and d.dwell_s == pytest.approx(9.6)
    d, _ = decide(state, ctx(110, est(8), FAT8, 100.0, THIN8))  # 10 s >= 9.6 s
    assert (d.swap, d.reason) == (True, "gain")
    # a 2.7x faster plan one second after the last swap: 1 s >= 0.21 s
    fast = plan(8, 4, 1, 2, 106.0)
    d, _ = decide(state, ctx(101, est(8), plan(8, 1, 4, 8, 285.0), 285.0, fast))
    assert (d.swap, d.reason, d.target) == (True, "gain", fast)
    # below the threshold it is the gain, not the time, that holds: 100/95 - 1 = 0.053
    d, _ = decide(state, ctx(101, est(8), FAT8, 100.0, plan(8, 4, 1, 2, 95.0)))
    assert d.reason == "gain-below-threshold"


def test_swaps_are_bounded_per_window() -> None:
    # 2 swaps in any 120 s: with no dwell and a gain at every tick, the third waits
    s = PolicySettings(min_dwell_s=0.0)
    other = plan(8, 2, 2, 4, 50.0)
    state, times = STABLE8, []
    for now in range(10, 250, 10):
        running = FAT8 if len(times) % 2 == 0 else other  # each swap lands: the other is better
        target = other if running is FAT8 else FAT8
        d, state = decide(state, ctx(now, est(8), running, 100.0, replace(target, predicted_latency_ms=50.0),
                                     settings=s))
        times += [now] if d.swap else []
        assert d.swap or d.reason == "swap-rate"
    # 10, 20 swap; 30..120 held (both within 120 s); 130: 10 left the window (130 - 10 = 120,
    # not < 120) -> swap; 140: 20 left -> swap; then 250 would be next
    assert times == [10, 20, 130, 140]
    assert state.swap_times == (130.0, 140.0) and state.swaps == 4
    # the bound holds cores-moved swaps too, and survives a restart (JSON state)
    back = policy_state_from_json(json.loads(json.dumps(policy_state_to_json(state))))
    assert back == state
    back = replace(back, misplaced_since_s=0.0)  # its cores moved long ago
    d, _ = decide(back, ctx(150, est(8), FAT8, 100.0, FAT8, misplaced=True))
    assert (d.swap, d.reason) == (False, "swap-rate")
    d, _ = decide(back, ctx(250, est(8), FAT8, 100.0, FAT8, misplaced=True))  # 250 - 130 >= 120
    assert (d.swap, d.reason) == (True, "cores-moved")
    # a larger bound lets the third through
    d, _ = decide(back, ctx(150, est(8), FAT8, 100.0, FAT8, misplaced=True,
                            settings=PolicySettings(max_swaps_per_window=3)))
    assert d.swap


def test_load_after_idle_restarts_the_clock() -> None:
    # The model held B=8 long ago, then went idle (t=10). Load comes back at t=12: the first
    # ticks still read the idle prior B = 1, and its cores were given back (misplaced).
    small, big = plan(1, 1, 1, 1, 30.0), plan(8, 2, 2, 4, 60.0)
    d, state = decide(STABLE8, ctx(10, est(1, idle=True), FAT8, 100.0, small, misplaced=True))
    assert d.reason == "idle" and state.seen_batch == 0 and state.seen_since_s == 10
    # t=12, not idle, B = 1: a new value since 12, held 0 s -> not moved for B = 1
    d, state = decide(state, ctx(12, est(1), FAT8, 100.0, small, misplaced=True))
    assert (d.swap, d.reason, state.seen_since_s) == (False, "estimate-settling", 12)
    # t=14 the estimator's step reads 8: held since 14; t=18.9: 4.9 s < 5
    d, state = decide(state, ctx(14, est(8), FAT8, 100.0, big, misplaced=True))
    d, state = decide(state, ctx(18.9, est(8), FAT8, 100.0, big, misplaced=True))
    assert d.reason == "estimate-settling"
    # t=19: 5 s -> moved once, straight to the plan for 8 on its cores
    d, state = decide(state, ctx(19, est(8), FAT8, 100.0, big, misplaced=True))
    assert (d.swap, d.reason, d.target) == (True, "cores-moved", big) and state.swaps == 1
