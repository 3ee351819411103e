"""The contention correction may change a choice only with a gap it can tell apart
(packrat.observe.policy's module doc, "Contention"): pure, ticks driven by a clock.

The case that found it: docs/benchmarks/step-two-sleep.md (its trace
step-two-sleep-trace.json). A sleep model, 2 cores, 8 clients: the active plan
2x(t1,b4) is profiled at 192 ms and served ~288 ms (1.5x: TorchServe's own time
per request, which every plan pays); 1x(t2,b8) is profiled at 240 ms. Booked as
contention against base 1 (or a base of one tick), that made factor(2) = 1.5 and
the policy swapped to the plan the profile predicts 25 % slower."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from packrat.observe.persist import policy_state_from_json, policy_state_to_json
from packrat.observe.policy import PolicyContext, PolicySettings, PolicyState, decide, update_correction
from packrat.types import Correction, Decision, Estimate, Instance, Plan

THIN = Plan(cores=2, batch=8, instances=(Instance(1, 4, 192.0),) * 2, predicted_latency_ms=192.0)
FAT = Plan(cores=2, batch=8, instances=(Instance(2, 8, 240.0),), predicted_latency_ms=240.0)
SETTINGS = PolicySettings()


def steady(t: float, served_ms: float) -> Estimate:
    """B = 8 read by window, EWMA and majority, 20 req/s over 5 s, `served_ms` of service."""
    return Estimate(time_s=t, model="sleepy-b", batch=8, ready=True, concurrency=8.0, rounded=8,
                    request_rate=20.0, span_s=5.0, mean_latency_ms=served_ms + 5.0, mean_queue_ms=5.0)


def run(state: PolicyState, active: Plan, ratio: float, t0: float, seconds: int,
        enabled: bool = True) -> tuple[list[Decision], PolicyState, float]:
    """Tick once a second for `seconds` with `active` serving at `ratio` x its profile
    (active since t0), the candidates THIN then FAT (the optimiser's order); stops at a swap."""
    decisions: list[Decision] = []
    for k in range(seconds):
        now = t0 + k
        served = steady(now, active.predicted_latency_ms * ratio)
        ctx = PolicyContext(now_s=now, model="sleepy-b", estimate=served, current=active,
                            current_latency_ms=active.predicted_latency_ms, candidates=(THIN, FAT),
                            active_since_s=t0, enabled=enabled, settings=SETTINGS)
        d, state = decide(state, ctx)
        decisions.append(d)
        if d.swap:
            break
    return decisions, state, t0 + len(decisions)


HELD = PolicyState(seen_batch=8, seen_since_s=0.0)


@pytest.mark.parametrize("history", [
    Correction(),  # no one-worker plan ever measured
    Correction(base=0.4424, base_samples=1),  # the trace's: one tick of 1x(t2,b1) at B = 1
])
def test_a_gap_shared_by_every_plan_does_not_swap_to_the_slower_fat_worker(history: Correction) -> None:
    decisions, state, _ = run(replace(HELD, correction=history), THIN, 1.5, 0.0, 120)
    # the gap never becomes a choice: no swap, the fat worker never preferred (the rule
    # before swapped to FAT at t = 24: 10 settled ticks booked 0.5 per co-runner)
    assert [(d.time_s, d.target) for d in decisions if d.swap or d.correction_changed_choice] == []
    learned = [d for d in decisions if d.latency_gap is not None]
    assert len(learned) > 2 * SETTINGS.min_correction_samples  # though measured, often
    assert learned[-1].latency_gap == pytest.approx(0.5)
    assert {d.reason for d in learned} == {"same-plan"}
    c = state.correction
    assert c.per_corunner == 0.0 and c.corunner_samples == 0
    m = SETTINGS.min_correction_samples
    assert c.factor(2, m) == pytest.approx(c.factor(1, m))  # the same for 1 and 2 workers
    if history.base_samples == 0:  # the gap went to base: reported latencies meet the observed
        assert c.base == pytest.approx(1.5) and c.pooled_samples == len(learned)
        assert decisions[-1].corrected_current_ms == pytest.approx(288.0)
    else:  # a base measured alone for a tick is kept apart from co-runners' ratios
        assert (c.base, c.base_samples, c.pooled_samples) == (0.4424, 1, 0)


def test_real_contention_is_learned_once_a_one_worker_plan_was_seen() -> None:
    # FAT runs first, pinned by the operator (a pinned plan still teaches the correction):
    # 1.1x its profile (what every plan pays), enough ticks to trust base
    decisions, state, t = run(HELD, FAT, 1.1, 0.0, 40, enabled=False)
    assert {d.reason for d in decisions} == {"disabled"}
    assert state.correction.base_samples == 40 - SETTINGS.settle_s
    assert state.correction.base == pytest.approx(1.1)
    # THIN then serves 1.65x its profile: 1.1 shared, and 1.5 for the co-runner
    decisions, state, _ = run(state, THIN, 1.65, t, 120)
    c = state.correction
    assert c.base == pytest.approx(1.1) and c.per_corunner == pytest.approx(0.5)
    # corrected THIN 192 * 1.1 * 1.5 = 316.8 ms against FAT 240 * 1.1 = 264 ms: gain 0.2
    last = decisions[-1]
    assert (last.swap, last.reason, last.target) == (True, "gain", FAT)
    assert last.correction_changed_choice and last.optimiser_choice == THIN
    assert last.corrected_gain == pytest.approx(316.8 / 264 - 1)


def test_unpinned_the_fat_plan_gives_way_to_the_profile_s_choice() -> None:
    # the same first phase unpinned: no contention known, so the profile decides (THIN
    # predicted 1.25x faster) once its dwell (60 s * (0.1/0.25)^2 = 9.6 s) has passed
    decisions, _, _ = run(HELD, FAT, 1.1, 0.0, 120)
    assert (decisions[-1].swap, decisions[-1].target, decisions[-1].time_s) == (True, THIN, 10.0)
    assert not decisions[-1].correction_changed_choice


def test_a_pooled_base_gives_way_to_the_first_one_worker_ratio() -> None:
    c = Correction()
    for _ in range(12):
        c = update_correction(c, 1.5, workers=2, settings=SETTINGS)
    assert (c.base, c.base_samples, c.pooled_samples) == (pytest.approx(1.5), 0, 12)
    assert c.factor(2, 10) == c.factor(1, 10) == pytest.approx(1.5)  # shared: cannot flip a choice
    c = update_correction(c, 1.1, workers=1, settings=SETTINGS)  # one worker alone: 1.1, not 1.5
    assert (c.base, c.base_samples, c.pooled_samples) == (pytest.approx(1.1), 1, 0)
    # until base is trusted a 2-worker ratio teaches nothing; then it is contention
    for _ in range(9):
        c = update_correction(c, 1.43, workers=2, settings=SETTINGS)
    assert (c.per_corunner, c.corunner_samples, c.base) == (0.0, 0, pytest.approx(1.1))
    for _ in range(9):
        c = update_correction(c, 1.1, workers=1, settings=SETTINGS)
    c = update_correction(c, 1.43, workers=2, settings=SETTINGS)
    assert c.per_corunner == pytest.approx(0.3) and c.corunner_samples == 1  # 1.43/1.1 - 1


def test_contention_learned_before_this_rule_is_dropped_when_base_becomes_trusted() -> None:
    # a state persisted by the old rule (the trace's end): 0.5 per co-runner against a one-tick base
    old = {"correction": {"base": 0.4424, "per_corunner": 0.5, "base_samples": 1,
                          "corunner_samples": 10, "last_ratio": 1.5}}
    c = policy_state_from_json(old).correction
    assert c.pooled_samples == 0
    assert c.factor(2, 10) == 1.0  # not used: its base is not measured
    for _ in range(9):
        c = update_correction(c, 1.0, workers=1, settings=SETTINGS)
    assert c.base_samples == 10 and (c.per_corunner, c.corunner_samples) == (0.0, 0)
    assert c.factor(2, 10) == pytest.approx(c.factor(1, 10))


def test_pooled_samples_travel_in_decision_lines_and_the_persisted_state() -> None:
    decisions, state, _ = run(HELD, THIN, 1.5, 0.0, 20)
    d = decisions[-1]
    assert d.correction.pooled_samples == 5  # ticks 15..19 settled
    line = json.loads(json.dumps(d.to_dict()))
    assert line["correction"]["pooled_samples"] == 5
    assert Decision.from_dict(line).to_dict() == d.to_dict()
    assert "pooled_samples" not in replace(d, correction=Correction()).to_dict()["correction"]
    assert policy_state_from_json(json.loads(json.dumps(policy_state_to_json(state)))) == state


def test_the_gap_is_measured_against_the_profiles_planned_from_now_not_the_stored_figure() -> None:
    # traffic-shape-bert-base-epyc-4: the live plan 2x(1t,b4) was applied from a 128-token
    # profile (stored prediction 1,057 ms); short texts came, the re-profile at 5 tokens
    # predicts the same plan at 62 ms and no swap follows (same shape). Served at 1.3x
    # the 62 ms, the correction must read 1.3, not 78 / 1,057 = 0.07 (clamped to 0.25).
    stored = replace(THIN, predicted_latency_ms=1057.0, instances=(Instance(1, 4, 1057.0),) * 2)
    state = HELD
    decisions = []
    for k in range(40):
        ctx = PolicyContext(now_s=float(k), model="sleepy-b", estimate=steady(float(k), 62.0 * 1.3),
                            current=stored, current_latency_ms=62.0, candidates=(THIN, FAT),
                            active_since_s=0.0, settings=SETTINGS)
        d, state = decide(state, ctx)
        decisions.append(d)
    learned = [d.latency_gap for d in decisions if d.latency_gap is not None]
    assert learned and learned[-1] == pytest.approx(0.3)
    assert decisions[-1].corrected_current_ms == pytest.approx(62.0 * 1.3)
