"""Cores are split between models only while their loads overlap in time (issue 32).

The estimator's quiet time (Estimate.quiet_s), then the controller's division of cores
(packrat.control.division.CoreDivision) with the real re-plan policy (AdaptiveLoop) fed
tick by tick, as the controller's tick does it: divide on the last decisions, then one
policy call per model, a swap it orders taking effect at once. Synthetic counters and a
clock; nothing sleeps and no server runs. Models: two copies of the table-latency sleep
model (its profile is its table: B = 8 runs 2x(t1,b4) in 192 ms on 2 cores, 300 ms on 1).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prometheus_client import CollectorRegistry

from packrat.bench.adapt_rig import sleep_table, table_profile
from packrat.bench.sleepmodel import SLEEP_MODEL
from packrat.control.division import CoreDivision
from packrat.control.metrics import ControllerMetrics
from packrat.control.statefiles import StateFiles
from packrat.control.values import ControllerSettings, ModelState
from packrat.observe.estimator import EstimatorState, estimate
from packrat.observe.loop import AdaptiveLoop
from packrat.observe.persist import estimator_state_from_json, estimator_state_to_json
from packrat.plan import realizable_plan
from packrat.profile.store import save_profile
from packrat.types import Correction, Decision, Estimate, Observation, TickContext

PROFILE = table_profile("sleepy", sleep_table(SLEEP_MODEL))
CORES = (0, 1)
LATENCY_S = 0.192  # the B = 8 plan on 2 cores
QUIET_S = ControllerSettings.concurrent_quiet_s


# -- the estimator's quiet time -----------------------------------------------------------

def _feed(steps: list[tuple[float, float, int | None]]) -> list[Estimate]:
    """Estimates of ticks 1 s apart; each step: (requests, latency µs) added since the
    tick before, and the pending requests then."""
    state, t, req, lat, out = EstimatorState(), 0.0, 0.0, 0.0, []
    for d_req, d_lat, pending in steps:
        req, lat = req + d_req, lat + d_lat
        est, state = estimate(state, Observation(t, "m", req, lat, 0.0, pending))
        out.append(est)
        t += 1.0
    return out


def test_quiet_s_is_zero_while_busy_and_grows_once_quiet() -> None:
    busy, quiet = (40.0, 8e6, 0), (0.0, 0.0, 0)
    out = _feed([busy] * 8 + [quiet] * 4 + [busy])
    assert [e.quiet_s for e in out[1:8]] == [0.0] * 7
    # The newest sample that showed load is tick 7: 1, 2, 3, 4 s later, then busy again.
    assert [e.quiet_s for e in out[8:12]] == [1.0, 2.0, 3.0, 4.0]
    assert out[12].quiet_s == 0.0
    # The window (5 s) still reads the load two ticks after it stopped: quiet_s is what says it did.
    assert not out[9].idle and out[9].concurrency is not None and out[9].concurrency > 4


def test_a_load_that_stops_within_a_tick_reads_quiet_from_where_it_stopped() -> None:
    # 8 clients (40 req/s at 200 ms: 8e6 µs of latency a second), stopping 0.25 s into tick 7:
    # 2e6 µs at the load's concurrency 8 fill 0.25 s of that tick (Little's law).
    out = _feed([(40.0, 8e6, 0)] * 7 + [(10.0, 2e6, 0)] + [(0.0, 0.0, 0)] * 2)
    assert out[7].quiet_s == 0.75 and out[8].quiet_s == 1.75 and out[9].quiet_s == 2.75
    # Requests that arrived and were not answered yet are in the server now.
    out = _feed([(40.0, 8e6, 0)] * 7 + [(3.0, 0.0, 0)])
    assert out[7].quiet_s == 0.0


def test_pending_requests_count_as_busy() -> None:
    # Requests queued but none finishing (a stalled worker): the counters stand still.
    out = _feed([(40.0, 8e6, 0)] * 6 + [(0.0, 0.0, 3)] * 3 + [(0.0, 0.0, 0)] * 2)
    assert [e.quiet_s for e in out[6:9]] == [0.0, 0.0, 0.0]
    assert [e.quiet_s for e in out[9:11]] == [1.0, 2.0]


def test_quiet_time_survives_the_wire_and_the_persisted_state() -> None:
    state = EstimatorState()
    for t, req in ((0.0, 0.0), (1.0, 10.0), (2.0, 10.0), (3.0, 10.0)):
        obs = Observation(t, "m", req, req * 1e5, 0.0, 0)
        est, state = estimate(estimator_state_from_json(estimator_state_to_json(state)), obs)
    assert est.quiet_s == 2.0
    line = Decision(time_s=3.0, model="m", swap=False, reason="idle", estimated_batch=1,
                    active_batch=None, target=None, optimiser_choice=None, current_ms=None,
                    candidate_ms=None, predicted_gain=None, corrected_current_ms=None,
                    corrected_candidate_ms=None, corrected_gain=None,
                    correction_changed_choice=False, observed_ms=None, latency_gap=None,
                    correction=Correction(),
                    estimate=est).to_dict()
    assert Decision.from_dict(line).estimate.quiet_s == 2.0
    del line["estimate"]["active_s"]  # a line written before the field: quiet time not known
    assert Decision.from_dict(line).estimate.quiet_s is None
    assert Estimate.from_dict(est.to_dict()).quiet_s == 2.0


# -- the division, tick by tick -----------------------------------------------------------

class TwoModels:
    """The controller's tick for models "a" and "b" on 2 cores, each starting on its plan
    for B = 8 on both cores; `tick(load)` advances the clock 1 s, load[m] being the
    (requests, latency µs) model m's counters gained in that second."""

    def __init__(self, tmp_path: Path) -> None:
        self.loop = AdaptiveLoop()
        self.division = CoreDivision(CORES, "given", StateFiles(tmp_path / "state"),
                                     ControllerMetrics(CollectorRegistry()), {}, 0.10, 120.0, QUIET_S)
        plan = realizable_plan(PROFILE, 2, 8)
        self.states = {m: ModelState(m, "1", "", plan, (), (), None, CORES) for m in ("a", "b")}
        self.paths = {m: tmp_path / f"{m}.json" for m in self.states}
        for path in self.paths.values():
            save_profile(PROFILE, path)
        self.policy_state: dict[str, dict] = {m: {} for m in self.states}
        self.counters = {m: (0.0, 0.0) for m in self.states}
        self.t = 0.5
        self.shares: list[tuple[float, dict[str, tuple[int, ...]]]] = []  # (time, division's shares)
        self.decisions: list[Decision] = []

    def tick(self, load: dict[str, tuple[float, float]]) -> None:
        self.t += 1.0
        for m, (d_req, d_lat) in load.items():
            req, lat = self.counters[m]
            self.counters[m] = (req + d_req, lat + d_lat)
        div = self.division
        div.divide([div.demand(self.loop, st, (), self.paths[m]) for m, st in self.states.items()],
                   list(self.states))
        assert div.division is not None
        self.shares.append((self.t, dict(div.division.shares)))
        for m in sorted(self.states, key=lambda m: not div.misplaced(self.states[m])):
            self._policy(m)

    def _policy(self, m: str) -> None:
        st, div = self.states[m], self.division
        req, lat = self.counters[m]
        ctx = TickContext(now=self.t, model=m, version=st.version, plan=st.plan,
                          observation=Observation(self.t, m, req, lat, 0.0, 0),
                          cores=len(div.share_of(m)), profile_path=self.paths[m],
                          misplaced=div.misplaced(st) and m in div.division.shares)  # type: ignore[union-attr]
        plan, self.policy_state[m] = self.loop(ctx, self.policy_state[m])
        self.decisions.append(self.loop.last_decisions(m, last=1)[-1])
        if plan is not None:  # the swap lands at once, on the model's cores now
            self.states[m] = replace(st, plan=plan, version=str(int(st.version) + 1),
                                     cores=div.share_of(m))


def closed_loop(clients: int, seconds: float = 1.0) -> tuple[float, float]:
    """What `clients` closed-loop clients add to the counters in `seconds` at LATENCY_S."""
    return clients * seconds / LATENCY_S, clients * seconds * 1e6


def alternate(phase_s: float, t: float) -> dict[str, tuple[float, float]]:
    """8 clients on "a" in even phases, on "b" in odd ones, over the second ending at t."""
    load = {"a": (0.0, 0.0), "b": (0.0, 0.0)}
    start = t - 1.0
    while start < t - 1e-9:  # split the second at a phase boundary
        end = min(t, (start // phase_s + 1) * phase_s)
        model = "a" if int(start // phase_s) % 2 == 0 else "b"
        req, lat = load[model]
        more = closed_loop(8, end - start)
        load[model] = (req + more[0], lat + more[1])
        start = end
    return load


def test_alternating_load_gives_each_model_the_machine_in_turn(tmp_path: Path) -> None:
    rig = TwoModels(tmp_path)
    for _ in range(180):
        rig.tick(alternate(5.0, rig.t + 1.0))
    # No swap at all: each model keeps its 2-core plan, nothing is moved for a brief split.
    assert [d.reason for d in rig.decisions if d.swap] == []
    assert not any(d.reason == "cores-moved" for d in rig.decisions)
    # After the first seconds of each phase the loaded model has both cores to itself.
    late = [(t, shares) for t, shares in rig.shares if t > 20 and t % 5.0 >= 2.0]
    assert late
    for t, shares in late:
        loaded = "a" if int(t // 5.0) % 2 == 0 else "b"
        assert shares == {loaded: CORES}, (t, shares)
    # A split lasts one tick at each phase boundary (the old load's quiet time).
    split = [t for t, shares in rig.shares if t > 20 and len(shares) == 2]
    assert len(split) <= (180 - 20) / 5.0


def test_concurrent_load_keeps_the_split(tmp_path: Path) -> None:
    rig = TwoModels(tmp_path)
    for _ in range(60):
        rig.tick({"a": closed_loop(8), "b": closed_loop(8)})
    assert all(d.estimate.quiet_s == 0.0 for d in rig.decisions if d.time_s > 2)
    # Both loaded every tick once the estimates are ready: split 1/1, as before.
    assert all(len(shares) == 2 for t, shares in rig.shares if t > 10)
    swapped = [d.model for d in rig.decisions if d.swap]
    assert sorted(swapped) == ["a", "b"]  # each moved once onto its own core, then nothing


def test_a_sparse_steady_load_does_not_flip_the_division(tmp_path: Path) -> None:
    rig = TwoModels(tmp_path)
    for k in range(120):
        sparse = (1.0, 0.12e6) if k % 3 == 0 else (0.0, 0.0)  # one 120 ms request every 3 s
        rig.tick({"a": sparse, "b": closed_loop(8)})
    quiet = [d.estimate.quiet_s for d in rig.decisions if d.model == "a" and d.time_s > 10]
    assert max(q for q in quiet if q is not None) >= 2.0  # its gaps outlast concurrent_quiet_s...
    # ...but not its own gaps (5 mean gaps of the window's rate): it stays loaded, the split holds.
    assert all(len(shares) == 2 for t, shares in rig.shares if t > 10)


def test_load_moving_for_good_frees_the_machine_within_seconds(tmp_path: Path) -> None:
    rig = TwoModels(tmp_path)
    step = 29.8  # the load moves from "a" to "b" 0.3 s into the tick ending at 30.5
    for _ in range(50):
        before = min(1.0, max(0.0, step - (rig.t)))  # of the second ending at rig.t + 1
        rig.tick({"a": closed_loop(8, before), "b": closed_loop(8, 1.0 - before)})
    alone = min(t for t, shares in rig.shares if t > step and shares == {"b": CORES})
    # a quiet from 29.8: 1.7 s at 31.5, the division next tick (the old code: 35.5).
    assert alone - step <= 3.0
