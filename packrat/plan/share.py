"""Cores divided among the models of one TorchServe (pure: no torch, no HTTP, no files).

    divide_cores(demands, cores) -> Division
    keep_or_move(previous, proposed, demands, threshold) -> (Division, why)

Every model with load (an estimated batch B) and a way to predict its latency
on c cores gets its own cores; the split minimises the worst model's
predicted latency at its own B, each latency multiplied by the model's weight
(default 1; a weight of 2 says "this model's milliseconds count double").

Exact, by a threshold search: for a target T each model needs the fewest
cores c_m(T) whose predicted latency is ≤ T; the least T whose needs fit in
the cores is the optimum (monotone: more cores never predict slower, because
a plan for c cores also fits on c + 1). Cores left over go, one at a time, to
the model that is then the slowest and still gains from one more core (ties:
the order the demands were given).

Rules for the rest (docs/live-plans.md, "Cores among models"):
  - Active models get contiguous runs of cores from the first usable core,
    in the order given; no two share a core when cores ≥ active models.
  - Fewer cores than active models: all of them share every core ("crowded"),
    as before this module existed: no split leaves a model without a core.
  - Idle models (no traffic) get no cores of their own. Their footprint is
    one 1-thread worker on the shared set, the last usable core: it costs
    nothing while they are idle and overlaps at most one core of an active
    model. When an idle model gets load it is active at the next division.
  - Models whose latency cannot be predicted (no profile yet) are left where
    they are and take no part in the split.
  - No active model: nothing is divided; every model may use every core.

Cost of 8 models x 64 cores: one prediction per (model, core count), 512
calls of the predictor (the realisable-plan search, cached), then a
threshold search over at most 512 values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Predictor = Callable[[int], "float | None"]


@dataclass(frozen=True)
class Demand:
    """One model as the division sees it."""

    model: str
    batch: int | None  # the load's estimated B; None: idle (no traffic)
    latency_ms: Predictor | None  # predicted latency (ms) at `batch` on c cores; None: cannot predict
    weight: float = 1.0


@dataclass(frozen=True)
class Division:
    """Which cores each model may use."""

    cores: tuple[int, ...]  # every usable core
    shares: dict[str, tuple[int, ...]] = field(default_factory=dict)  # active model -> its own cores
    idle: tuple[str, ...] = ()  # models on the shared set
    unplanned: tuple[str, ...] = ()  # active but no prediction: left where they are
    predicted_ms: dict[str, float] = field(default_factory=dict)  # active model -> latency on its share
    rule: str = "no-load"  # no-load | split | crowded

    @property
    def shared(self) -> tuple[int, ...]:
        """The idle models' footprint: the last usable core."""
        return self.cores[-1:]

    def cores_of(self, model: str) -> tuple[int, ...]:
        """Where `model`'s workers may run: its share, the shared set when idle, else every core."""
        if model in self.shares:
            return self.shares[model]
        if model in self.idle and self.rule == "split":
            return self.shared
        return self.cores

    def worst_ms(self, weights: dict[str, float] | None = None) -> float | None:
        vals = [ms * (weights or {}).get(m, 1.0) for m, ms in self.predicted_ms.items()]
        return max(vals) if vals else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "cores": list(self.cores),
            "rule": self.rule,
            "shares": {m: list(c) for m, c in self.shares.items()},
            "shared": list(self.shared) if self.rule == "split" else list(self.cores),
            "idle": list(self.idle),
            "unplanned": list(self.unplanned),
            "predicted_ms": dict(self.predicted_ms),
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Division:
        return Division(
            cores=tuple(int(c) for c in data["cores"]),
            shares={str(m): tuple(int(c) for c in cs) for m, cs in data.get("shares", {}).items()},
            idle=tuple(data.get("idle", ())),
            unplanned=tuple(data.get("unplanned", ())),
            predicted_ms={str(m): float(v) for m, v in data.get("predicted_ms", {}).items()},
            rule=str(data.get("rule", "no-load")),
        )


def _table(d: Demand, max_cores: int) -> list[float]:
    """Weighted predicted latency on 1..max_cores cores (index c - 1), made non-increasing:
    with c + 1 cores the plan for c still fits."""
    assert d.latency_ms is not None
    out: list[float] = []
    best = math.inf
    for c in range(1, max_cores + 1):
        v = d.latency_ms(c)
        if v is not None and v > 0:
            best = min(best, v * d.weight)
        out.append(best)
    return out


def divide_cores(demands: Sequence[Demand], cores: Sequence[int]) -> Division:
    """The min–max division of `cores` among the active demands (see module docstring)."""
    cores = tuple(cores)
    if not cores:
        raise ValueError("no cores to divide")
    for d in demands:
        if d.weight <= 0:
            raise ValueError(f"{d.model}: weight must be > 0, got {d.weight}")
    loaded = [d for d in demands if d.batch is not None]
    active = [d for d in loaded if d.latency_ms is not None]
    idle = tuple(d.model for d in demands if d.batch is None)
    unplanned = tuple(d.model for d in loaded if d.latency_ms is None)
    if not active:
        return Division(cores, idle=idle, unplanned=unplanned, rule="no-load")
    n = len(cores)
    if n < len(active):
        return Division(cores, idle=idle, unplanned=unplanned, rule="crowded")

    most = n - len(active) + 1  # each of the others needs at least one core
    tables = {d.model: _table(d, most) for d in active}
    if all(math.isinf(t[-1]) for t in tables.values()):
        return Division(cores, idle=idle, unplanned=tuple(d.model for d in loaded), rule="no-load")

    def need(table: list[float], limit: float) -> int:
        for c, v in enumerate(table, start=1):
            if v <= limit:
                return c
        return n + 1  # cannot reach it

    # Least feasible threshold among the values the tables take (binary search: need() is monotone).
    values = sorted({v for t in tables.values() for v in t if not math.isinf(v)})
    lo, hi = 0, len(values) - 1
    if sum(need(t, values[hi]) for t in tables.values()) > n:
        # Some model cannot be predicted on any core count it could get: give every
        # model one core and the rest by the greedy step below.
        counts = {d.model: 1 for d in active}
    else:
        while lo < hi:
            mid = (lo + hi) // 2
            if sum(need(t, values[mid]) for t in tables.values()) <= n:
                hi = mid
            else:
                lo = mid + 1
        counts = {m: need(t, values[lo]) for m, t in tables.items()}

    # Leftover cores: to the slowest model that still gains from one more.
    left = n - sum(counts.values())
    while left > 0:
        gaining = [d.model for d in active if counts[d.model] < most
                   and tables[d.model][counts[d.model]] < tables[d.model][counts[d.model] - 1]]
        if not gaining:
            gaining = [d.model for d in active if counts[d.model] < most] or [active[0].model]
        order = [d.model for d in active]
        pick = max(gaining, key=lambda m: (tables[m][counts[m] - 1], -order.index(m)))
        counts[pick] += 1
        left -= 1

    shares: dict[str, tuple[int, ...]] = {}
    offset = 0
    for d in active:
        shares[d.model] = cores[offset: offset + counts[d.model]]
        offset += counts[d.model]
    weights = {d.model: d.weight for d in active}
    predicted = {m: tables[m][counts[m] - 1] / weights[m]
                 for m in counts if not math.isinf(tables[m][counts[m] - 1])}
    return Division(cores, shares, idle, unplanned, predicted, "split")


def evaluate(division: Division, demands: Sequence[Demand]) -> float | None:
    """The worst weighted predicted latency of `demands` on `division`'s shares (None: cannot say)."""
    worst = None
    for d in demands:
        if d.batch is None or d.latency_ms is None:
            continue
        share = division.shares.get(d.model)
        if share is None:
            return None
        v = d.latency_ms(len(share))
        if v is None:
            return None
        worst = max(worst or 0.0, v * d.weight)
    return worst


def keep_or_move(previous: Division | None, proposed: Division, demands: Sequence[Demand],
                 threshold: float) -> tuple[Division, str]:
    """Hysteresis: keep the previous division unless the set of active models changed or the
    proposed one is predicted more than `threshold` better (0.10 = the worst model 1.1x
    faster), like the re-plan policy's gain threshold for one model."""
    if previous is None or previous.cores != proposed.cores:
        return proposed, "first"
    if set(previous.shares) != set(proposed.shares) or previous.rule != proposed.rule:
        return proposed, "models-changed"
    if previous.shares == proposed.shares:
        return previous, "same"
    now = evaluate(previous, demands)
    new = evaluate(proposed, demands)
    if now is None or new is None:
        return proposed, "no-prediction"
    if now / new - 1.0 > threshold:
        return proposed, "gain"
    # Keep the split, but refresh the idle list and the predictions at today's load.
    kept = Division(previous.cores, previous.shares, proposed.idle, proposed.unplanned,
                    {d.model: d.latency_ms(len(previous.shares[d.model])) or 0.0
                     for d in demands if d.model in previous.shares and d.latency_ms is not None},
                    previous.rule)
    return kept, "gain-below-threshold"
