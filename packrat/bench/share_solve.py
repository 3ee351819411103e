"""How long the joint division of cores takes at the issue's scale: 8 models x 64 cores x
B <= 1024 (scripts/bench_share.py says which profiles). Each repeat starts from a cold
plan cache (realizable_plan is cached per profile, cores, batch).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from packrat.bench.machine import describe_machine
from packrat.bench.paths import REPO
from packrat.errors import PackratError
from packrat.plan import knapsack, realizable_plan
from packrat.plan.share import Demand, divide_cores
from packrat.profile import load_profile
from packrat.types import Profile

DATA = REPO / "tests" / "data" / "packrat-icml25"
BATCHES = [1024, 512, 256, 64, 32, 8, 4, 1]


def _predict(prof: Profile, batch: int) -> Callable[[int], float | None]:
    most = max(p.batch for p in prof.points)

    def predict(c: int) -> float | None:
        try:
            return realizable_plan(prof, c, min(batch, c * most)).predicted_latency_ms
        except PackratError:
            return None
    return predict


def time_division(repeat: int, cores: int, command: str) -> dict:
    """`repeat` cold divisions of `cores` among the 8 models; the JSON the command prints."""
    profiles = [load_profile(DATA / f) for f in ("resnet-default.csv", "inception-default.csv", "gpt2-default.csv")]
    runs = []
    for _ in range(repeat):
        knapsack._solve_realizable.cache_clear()
        demands = []
        for i, batch in enumerate(BATCHES):
            prof = profiles[i % 3]
            demands.append(Demand(f"m{i}-{prof.model_id}-B{batch}", batch, _predict(prof, batch)))
        t0 = time.perf_counter()
        division = divide_cores(demands, range(cores))
        runs.append(time.perf_counter() - t0)
    return {
        "cpu": describe_machine().cpu, "loadavg": os.getloadavg(), "command": command,
        "models": len(BATCHES), "cores": cores, "batches": BATCHES,
        "seconds": [round(x, 4) for x in runs], "max_s": round(max(runs), 4),
        "division": {m: len(c) for m, c in division.shares.items()},
        "predicted_ms": {m: round(v, 2) for m, v in division.predicted_ms.items()},
    }
