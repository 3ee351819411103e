"""Cores divided among models (packrat.plan.share): exact min–max, weights, idle, hysteresis."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from packrat.plan import realizable_plan
from packrat.plan.share import Demand, Division, divide_cores, evaluate, keep_or_move
from packrat.profile import load_profile

DATA = Path(__file__).resolve().parent / "data" / "packrat-icml25"


def amdahl(serial_ms: float, parallel_ms: float):
    """A latency curve that keeps gaining from cores, less each time."""
    return lambda c: serial_ms + parallel_ms / c


def brute_force_worst(demands: list[Demand], n: int) -> float:
    """The least worst weighted latency over every split of n cores (each model >= 1)."""
    k = len(demands)
    best = float("inf")
    for cut in itertools.combinations(range(1, n), k - 1):
        counts = [b - a for a, b in zip((0, *cut), (*cut, n))]
        worst = max(min(d.latency_ms(c) for c in range(1, cnt + 1)) * d.weight
                    for d, cnt in zip(demands, counts))
        best = min(best, worst)
    return best


def test_split_balances_the_slower_model():
    # A heavy model needs more cores than a light one to reach the same latency.
    heavy = Demand("heavy", 8, amdahl(10, 400))
    light = Demand("light", 8, amdahl(10, 40))
    d = divide_cores([heavy, light], range(8))
    assert d.rule == "split"
    assert len(d.shares["heavy"]) > len(d.shares["light"]) >= 1
    assert sum(len(c) for c in d.shares.values()) == 8
    # Disjoint, contiguous, in the order given.
    assert d.shares["heavy"] == tuple(range(len(d.shares["heavy"])))
    assert not set(d.shares["heavy"]) & set(d.shares["light"])
    assert d.worst_ms() == pytest.approx(brute_force_worst([heavy, light], 8))


def test_weights_move_cores():
    a = Demand("a", 4, amdahl(5, 100))
    b = Demand("b", 4, amdahl(5, 100))
    even = divide_cores([a, b], range(8))
    assert len(even.shares["a"]) == len(even.shares["b"]) == 4
    weighted = divide_cores([Demand("a", 4, amdahl(5, 100), weight=3.0), b], range(8))
    assert len(weighted.shares["a"]) > 4


@pytest.mark.parametrize("seed", range(30))
def test_exact_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    k = rng.randint(1, min(4, n))
    demands = [Demand(f"m{i}", 4, amdahl(rng.uniform(1, 50), rng.uniform(10, 500)),
                      weight=rng.choice([1.0, 1.0, 2.0, 0.5])) for i in range(k)]
    d = divide_cores(demands, range(n))
    worst = max(d.predicted_ms[x.model] * x.weight for x in demands)
    assert worst == pytest.approx(brute_force_worst(demands, n))
    assert sorted(c for cs in d.shares.values() for c in cs) == list(range(n))


def test_flat_curves_still_use_every_core():
    # A model that gains nothing from a second core still leaves no core unassigned.
    flat = Demand("flat", 1, lambda c: 20.0)
    d = divide_cores([flat, Demand("other", 1, lambda c: 10.0)], range(4))
    assert sum(len(c) for c in d.shares.values()) == 4


def test_idle_models_share_the_last_core():
    d = divide_cores([Demand("busy", 8, amdahl(5, 100)), Demand("quiet", None, amdahl(5, 100))],
                     (4, 5, 6, 7))
    assert d.shares == {"busy": (4, 5, 6, 7)}
    assert d.idle == ("quiet",)
    assert d.cores_of("quiet") == (7,) == d.shared
    assert d.cores_of("busy") == (4, 5, 6, 7)


def test_no_load_and_crowded_and_unplanned():
    none = divide_cores([Demand("a", None, None), Demand("b", None, amdahl(1, 1))], (0, 1))
    assert none.rule == "no-load" and none.cores_of("a") == (0, 1) == none.cores_of("b")
    crowded = divide_cores([Demand(m, 2, amdahl(1, 10)) for m in "abc"], (0, 1))
    assert crowded.rule == "crowded" and crowded.cores_of("a") == (0, 1)
    unplanned = divide_cores([Demand("p", 2, amdahl(1, 10)), Demand("u", 2, None)], (0, 1))
    assert unplanned.unplanned == ("u",) and unplanned.shares == {"p": (0, 1)}
    assert unplanned.cores_of("u") == (0, 1)  # left where it is: every core


def test_unpredictable_core_counts_are_skipped():
    # Only even core counts are predicted (e.g. a profile of 2 and 4 threads only).
    even = Demand("even", 8, lambda c: 100.0 / c if c % 2 == 0 else None)
    d = divide_cores([even, Demand("any", 8, amdahl(5, 50))], range(6))
    assert len(d.shares["even"]) >= 2
    assert d.predicted_ms["even"] == pytest.approx(100.0 / (len(d.shares["even"]) // 2 * 2))


def test_hysteresis_keeps_a_split_unless_clearly_better():
    a = Demand("a", 4, amdahl(5, 100))
    b = Demand("b", 4, amdahl(5, 100))
    first, why = keep_or_move(None, divide_cores([a, b], range(8)), [a, b], 0.10)
    assert why == "first" and len(first.shares["a"]) == 4
    # b's load grows a little: the best split moves one core, but gains < 10 %.
    b2 = Demand("b", 4, amdahl(5, 140))  # 40 ms on 4 cores; 5 + 3 gives 38.3
    proposed = divide_cores([a, b2], range(8))
    assert proposed.shares != first.shares
    kept, why = keep_or_move(first, proposed, [a, b2], 0.10)
    assert why == "gain-below-threshold" and kept.shares == first.shares
    # b's load grows a lot: the split moves.
    b3 = Demand("b", 4, amdahl(5, 600))
    moved, why = keep_or_move(first, divide_cores([a, b3], range(8)), [a, b3], 0.10)
    assert why == "gain" and len(moved.shares["b"]) > 4
    assert evaluate(moved, [a, b3]) < evaluate(first, [a, b3])
    # A model going idle changes the set of active models: move at once.
    gone, why = keep_or_move(first, divide_cores([a, Demand("b", None, None)], range(8)),
                             [a, Demand("b", None, None)], 0.10)
    assert why == "models-changed" and gone.shares == {"a": tuple(range(8))}


def test_round_trip():
    d = divide_cores([Demand("a", 4, amdahl(5, 100)), Demand("q", None, None)], (2, 3, 5))
    assert Division.from_dict(d.to_dict()) == d


def test_real_profiles_eight_models_64_cores():
    """The issue's scale: 8 models x 64 cores x B <= 1024, from the Packrat authors' profiles
    (timed in scripts/bench_share.py, not here)."""
    profiles = [load_profile(DATA / f) for f in ("resnet-default.csv", "inception-default.csv",
                                                 "gpt2-default.csv")]
    demands = []
    for i in range(8):
        prof = profiles[i % 3]
        batch = [1, 8, 64, 1024, 32, 256, 4, 512][i]
        most = max(p.batch for p in prof.points)
        demands.append(Demand(f"m{i}", batch,
                              lambda c, prof=prof, batch=batch, most=most:
                              realizable_plan(prof, c, min(batch, c * most)).predicted_latency_ms))
    d = divide_cores(demands, range(64))
    assert d.rule == "split" and len(d.shares) == 8
    assert sorted(c for cs in d.shares.values() for c in cs) == list(range(64))
    # Min–max: no single core moved from one model to another lowers the worst latency.
    worst = d.worst_ms()
    for give, take in itertools.permutations(d.shares, 2):
        if len(d.shares[give]) == 1:
            continue
        counts = {m: len(c) for m, c in d.shares.items()}
        counts[give] -= 1
        counts[take] += 1
        moved = max(next(x for x in demands if x.model == m).latency_ms(c) for m, c in counts.items())
        assert moved >= worst - 1e-9
