"""How long the joint division of cores takes at the issue's scale: 8 models x 64 cores x
B <= 1024 (scripts/bench_share.py says which profiles), each model predicted as the
controller predicts it. Each repeat starts from a cold plan cache (realizable_plan is
cached per profile, cores, batch).
"""

from __future__ import annotations

import os
import time

from packrat.bench.machine import describe_machine
from packrat.bench.paths import REPO
from packrat.control.division import predictor
from packrat.plan import knapsack
from packrat.plan.share import Demand, divide_cores
from packrat.profile import load_profile

DATA = REPO / "tests" / "data" / "packrat-icml25"
BATCHES = [1024, 512, 256, 64, 32, 8, 4, 1]


def time_division(repeat: int, cores: int, command: str) -> dict:
    """`repeat` cold divisions of `cores` among the 8 models; the JSON the command prints."""
    files = [DATA / f for f in ("resnet-default.csv", "inception-default.csv", "gpt2-default.csv")]
    profiles = [load_profile(f) for f in files]
    runs = []
    for _ in range(repeat):
        knapsack._solve_realizable.cache_clear()
        demands = []
        for i, batch in enumerate(BATCHES):
            prof = profiles[i % 3]
            # The controller's own predictor: its best realisable plan on c cores, from the file.
            predict = predictor((), files[i % 3], batch)
            assert predict is not None  # the file exists
            demands.append(Demand(f"m{i}-{prof.model_id}-B{batch}", batch, predict))
        t0 = time.perf_counter()
        division = divide_cores(demands, range(cores))
        runs.append(time.perf_counter() - t0)
    return {
        "cpu": describe_machine().label, "loadavg": os.getloadavg(), "command": command,
        "models": len(BATCHES), "cores": cores, "batches": BATCHES,
        "seconds": [round(x, 4) for x in runs], "max_s": round(max(runs), 4),
        "division": {m: len(c) for m, c in division.shares.items()},
        "predicted_ms": {m: round(v, 2) for m, v in division.predicted_ms.items()},
    }
