"""AdaptiveLoop as the controller's policy, driven tick by tick without a server:
TickContexts as packrat.control builds them, a profile file on disk."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from packrat.types import TickContext
from packrat.observe.loop import AdaptiveLoop, adapt_settings
from packrat.plan import same_shape
from packrat.bench.adapt_rig import sleep_table, table_profile
from packrat.plan import realizable_plan
from packrat.profile.store import save_profile
from packrat.types import Observation

SLEEP_MODEL = Path(__file__).parent / "data" / "observe" / "sleepmodel"
PROFILE = table_profile("sleepy", sleep_table(SLEEP_MODEL))
PLAN1 = realizable_plan(PROFILE, 2, 1)  # 1 × (2 threads, cap 1)
PLAN8 = realizable_plan(PROFILE, 2, 8)  # 2 × (1 thread, cap 4)


class Driver:
    """Ticks one model at 1 s; `concurrency` requests of 100 ms in flight."""

    def __init__(self, tmp: Path, loop: AdaptiveLoop, plan=PLAN1, version="p1") -> None:
        self.profile_path = tmp / "sleepy.json"
        save_profile(PROFILE, self.profile_path)
        self.loop, self.plan, self.version = loop, plan, version
        self.t, self.req, self.lat = 1000.0, 0.0, 0.0
        self.state: dict = {}
        self.lines: list[str] = []

    def ctx(self, **kw) -> TickContext:
        obs = Observation(self.t, "sleepy", self.req, self.lat, 0.0)
        base = dict(now=self.t, model="sleepy", version=self.version, plan=self.plan,
                    observation=obs, cores=2, profile_path=self.profile_path)
        base.update(kw)
        return TickContext(**base)

    def tick(self, concurrency: float, **kw):
        self.t += 1.0
        self.req += 10 * concurrency
        self.lat += concurrency * 1e6
        plan, self.state = self.loop(self.ctx(**kw), self.state)
        json.dumps(self.state)  # the controller persists it as JSON
        if plan is not None:  # the controller swaps it in (here at once: a new version)
            self.plan, self.version = plan, f"{self.version}+"
        return plan


def new_loop(lines: list[str] | None = None, **kw) -> AdaptiveLoop:
    sink = lines if lines is not None else []
    return AdaptiveLoop(adapt_settings(**kw), emit=sink.append)


def test_steps_to_the_plan_for_the_new_batch(tmp_path: Path) -> None:
    lines: list[str] = []
    d = Driver(tmp_path, new_loop(lines))
    plans = [d.tick(1) for _ in range(10)]
    assert plans == [None] * 10  # B = 1 and PLAN1 is the plan for 1: "same-plan"
    plans = [d.tick(8) for _ in range(20)]
    swaps = [(i, p) for i, p in enumerate(plans) if p is not None]
    # B reads 8 at the 2nd tick after the step (the estimator's step detector, see its
    # test); the gain (2.75) is >= fast_gain and the window reads 8, so B need hold only
    # fast_stable_s, not min_stable_s: the swap is ordered at the next tick, index 2, once
    assert [i for i, _ in swaps] == [2]
    assert same_shape(swaps[0][1], PLAN8) and swaps[0][1].batch == 8
    # one JSON line per tick, the swap among them
    decisions = [json.loads(x) for x in lines]
    assert len(decisions) == 30
    assert [x["reason"] for x in decisions if x["swap"]] == ["gain"]
    # plan for 1 at B=8: 8 rounds of 90 ms = 720; plan for 8: L(1,4) = 192 -> gain 720/192 - 1 = 2.75
    swap = next(x for x in decisions if x["swap"])
    assert swap["current_ms"] == 720.0 and swap["candidate_ms"] == 192.0
    assert swap["predicted_gain"] == pytest.approx(2.75)


def test_state_resumes_in_a_new_loop(tmp_path: Path) -> None:
    a = Driver(tmp_path, new_loop())
    for _ in range(10):
        a.tick(1)
    a.tick(8)  # restart before the swap (ordered at the 3rd tick at 8, as above)
    # a restarted controller: new loop object, state read back from JSON
    b = Driver(tmp_path, new_loop())
    b.t, b.req, b.lat, b.state = a.t, a.req, a.lat, json.loads(json.dumps(a.state))
    got_a = [a.tick(8) for _ in range(10)]
    got_b = [b.tick(8) for _ in range(10)]
    assert [p is not None for p in got_a] == [p is not None for p in got_b]
    assert sum(p is not None for p in got_b) == 1


def test_disable_is_persisted_and_blocks_swaps(tmp_path: Path) -> None:
    lines: list[str] = []
    loop = new_loop(lines)
    d = Driver(tmp_path, loop)
    loop.set_enabled("sleepy", False)
    plans = [d.tick(8) for _ in range(25)]
    assert plans == [None] * 25
    assert json.loads(lines[-1])["reason"] == "disabled" and d.state["enabled"] is False
    # a new loop from the persisted state stays disabled
    d2 = Driver(tmp_path, new_loop())
    d2.t, d2.req, d2.lat, d2.state = d.t, d.req, d.lat, d.state
    assert d2.tick(8) is None and d2.loop.status("sleepy")["last_decision"]["reason"] == "disabled"
    assert d2.loop.is_enabled("sleepy") is False
    d2.loop.set_enabled("sleepy", True)
    assert d2.tick(8) is not None  # B = 8 held long ago, no dwell: swaps at once


def test_swap_in_progress_and_version_change(tmp_path: Path) -> None:
    loop = new_loop()
    d = Driver(tmp_path, loop)
    for _ in range(20):
        d.tick(8, swap_in_progress=True)
    assert loop.decisions("sleepy", 1)[0]["reason"] == "swap-in-progress"
    # the controller swapped (e.g. over REST): the loop notices the new version
    d.version, d.plan = "p2", PLAN8
    d.tick(8)
    assert d.state["active_since_s"] == d.t
    text = generate_latest(loop.registry).decode()
    assert 'packrat_adapt_version_changes_total{model="sleepy"} 1.0' in text
    assert 'packrat_adapt_decisions_total{model="sleepy",reason="swap-in-progress"} 20.0' in text
    assert 'packrat_estimated_batch{model="sleepy"} 8.0' in text
    assert 'packrat_batch_estimates_total{batch="8",model="sleepy"}' in text


def test_no_metrics_and_no_profile(tmp_path: Path) -> None:
    loop = new_loop()
    d = Driver(tmp_path, loop)
    plan, state = loop(replace(d.ctx(), observation=None), {})
    assert plan is None and "estimator" not in state
    # no profile: no candidates, so never a swap
    for _ in range(15):
        assert d.tick(8, profile_path=None) is None
    assert loop.decisions("sleepy", 1)[0]["reason"] == "no-plan"


def test_load_beyond_the_profile_gets_the_largest_plan(tmp_path: Path) -> None:
    # 64 clients; the profile stops at b=8 on 2 cores: plan for 2 x 8 = 16
    d = Driver(tmp_path, new_loop())
    plans = [d.tick(64) for _ in range(20)]
    swaps = [p for p in plans if p is not None]
    assert len(swaps) == 1 and swaps[0].batch == 16
    assert same_shape(swaps[0], realizable_plan(PROFILE, 2, 16))
    assert d.loop.decisions("sleepy", 1)[0]["estimated_batch"] == 64


def test_unusable_profile_means_no_plan(tmp_path: Path) -> None:
    loop = new_loop()
    d = Driver(tmp_path, loop)
    (tmp_path / "garbage.json").write_text("{not json")
    for _ in range(15):
        assert d.tick(8, profile_path=tmp_path / "garbage.json") is None
    last = loop.decisions("sleepy", 1)[0]
    assert last["reason"] == "no-plan" and last["estimated_batch"] == 8  # still estimating


def test_a_bug_does_not_kill_the_tick(tmp_path: Path) -> None:
    lines: list[str] = []
    loop = new_loop(lines)
    d = Driver(tmp_path, loop)
    bad = replace(d.ctx(), now=None)  # not a time: the estimator fails
    plan, state = loop(bad, {"keep": 1})
    assert plan is None and state == {"keep": 1}
    assert "error" in json.loads(lines[-1])


def _correction_after(d: Driver, lines: list[str], ticks: int) -> dict:
    for _ in range(ticks):
        d.tick(1)
    return json.loads(lines[-1])["correction"]


def test_a_new_profile_starts_the_correction_again(tmp_path: Path) -> None:
    """The correction is learnt against the profile planned from; a re-profile (here: the
    file replaced by one with another `created`) must not inherit it."""
    import os

    lines: list[str] = []
    d = Driver(tmp_path, new_loop(lines))
    learnt = _correction_after(d, lines, 40)  # 100 ms served against 90 ms profiled, settled
    assert learnt["base_samples"] > 0 and learnt["base"] != 1.0
    # The same profile file read again keeps what was learnt.
    assert _correction_after(d, lines, 1)["base_samples"] >= learnt["base_samples"]
    save_profile(replace(PROFILE, extra={**PROFILE.extra, "created": "2026-12-05T00:00:00Z"}), d.profile_path)
    st = d.profile_path.stat()
    os.utime(d.profile_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the loop re-reads on mtime
    fresh = _correction_after(d, lines, 1)
    # Started again: at most this tick's own sample, not the 20-odd learnt before.
    assert fresh["base_samples"] <= 1 < learnt["base_samples"]


def _sized(profile, tokens: int, created: str = "2026-12-05T01:00:00Z"):
    """`profile` as if timed at `tokens`-token texts (its settings' sizes, as the profiler writes them)."""
    return replace(profile, extra={**profile.extra, "created": created, "settings": {"sizes": [["tokens", tokens]]}})


def _ticks(d: Driver, lines: list[str], n: int, tokens: int | None) -> dict:
    """`n` ticks of the same load whose traffic lately is `tokens`-token texts (None: not known);
    the last decision line."""
    for _ in range(n):
        d.tick(1, traffic=(("tokens", tokens),) if tokens is not None else ())
    return json.loads(lines[-1])


def test_traffic_moved_from_where_the_correction_was_learnt_starts_it_again(tmp_path: Path) -> None:
    """A correction is learnt at one input shape: traffic that moved beyond the shift factor
    (packrat.profile.shape.shifted) from it starts it again, under the same profile (its timed
    sizes not known here, so every tick may teach it). The old loop kept it (40 samples)."""
    lines: list[str] = []
    d = Driver(tmp_path, new_loop(lines))
    learnt = _ticks(d, lines, 40, 5)["correction"]  # 100 ms served against 90 ms profiled, settled
    assert learnt["base_samples"] > 0 and learnt["base"] != 1.0
    assert d.state["correction_sizes"] == {"tokens": 5}
    # Within the factor (5 -> 7): the same shape, kept and still learning.
    assert _ticks(d, lines, 1, 7)["correction"]["base_samples"] == learnt["base_samples"] + 1
    # Not known this tick (too few requests lately): nothing to move from, kept.
    assert _ticks(d, lines, 1, None)["correction"]["base_samples"] == learnt["base_samples"] + 2
    moved = _ticks(d, lines, 1, 40)
    assert moved["correction"]["base_samples"] <= 1 < learnt["base_samples"]  # at most this tick's own
    assert d.state["correction_sizes"] == {"tokens": 40}  # learnt at the new shape from now on
    assert moved["traffic_sizes"] == {"tokens": 40} and "predicted_for" not in moved  # profile's not known


def test_ticks_the_profile_does_not_cover_teach_the_correction_nothing(tmp_path: Path) -> None:
    """A 5-token profile serving 128-token texts: observed/predicted measures the input, not
    contention, so the correction learns nothing from it (the traffic-shape run learnt the 4x
    clamp and said 3878 ms); the gap is still reported, and each decision says which sizes
    its predictions are for and which the traffic has. The old loop learnt 37 samples here."""
    lines: list[str] = []
    d = Driver(tmp_path, new_loop(lines))
    save_profile(_sized(PROFILE, 5), d.profile_path)
    uncovered = _ticks(d, lines, 40, 128)
    assert uncovered["predicted_for"] == {"tokens": 5} and uncovered["traffic_sizes"] == {"tokens": 128}
    assert uncovered["correction"]["base_samples"] == 0 and uncovered["correction"]["base"] == 1.0
    assert uncovered["latency_gap"] == pytest.approx(100 / 90 - 1, rel=0.05)  # measured, reported
    assert uncovered["corrected_current_ms"] == uncovered["current_ms"]
    assert "correction_sizes" not in d.state
    covered = _ticks(d, lines, 40, 6)  # texts the profile covers (within the factor of 5): learnt
    assert covered["correction"]["base_samples"] > 0 and covered["correction"]["base"] > 1.0
    assert d.state["correction_sizes"] == {"tokens": 6}


def test_decision_lines_with_sizes_read_back_and_old_lines_stay_as_they_were(tmp_path: Path) -> None:
    from packrat.types import Decision

    lines: list[str] = []
    d = Driver(tmp_path, new_loop(lines))
    save_profile(_sized(PROFILE, 5), d.profile_path)
    line = _ticks(d, lines, 3, 6)
    back = Decision.from_dict(line)
    assert back.predicted_for == (("tokens", 5),) and back.traffic_sizes == (("tokens", 6),)
    assert back.to_dict()["predicted_for"] == {"tokens": 5}
    old = {k: v for k, v in line.items() if k not in ("predicted_for", "traffic_sizes")}
    sizeless = {k: v for k, v in back.to_dict().items() if k not in ("predicted_for", "traffic_sizes")}
    assert Decision.from_dict(old).to_dict() == sizeless  # no sizes written where none were known
    with pytest.raises(ValueError, match="sizes"):
        Decision.from_dict({**line, "predicted_for": {"tokens": "five"}})
