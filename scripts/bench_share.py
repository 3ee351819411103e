"""How long the joint division of cores takes at the issue's scale: 8 models x 64 cores x B <= 1024.

    python scripts/bench_share.py [--repeat 5] > docs/benchmarks/share-solve.json

Profiles: the Packrat authors' 16-core Xeon profiles (tests/data/packrat-icml25; ResNet-50,
Inception-v3, GPT-2), reused for 8 models with different batches, planned for 64 cores (the
optimiser reaches core counts beyond the profiled threads by running more instances).
Each repeat starts from a cold plan cache (realizable_plan is cached per profile, cores, batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from packrat.plan import knapsack, realizable_plan
from packrat.plan.share import Demand, divide_cores
from packrat.profile import load_profile
from packrat.errors import PackratError
from packrat.bench.machine import describe_machine

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "packrat-icml25"
BATCHES = [1024, 512, 256, 64, 32, 8, 4, 1]



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cores", type=int, default=64)
    args = ap.parse_args()
    profiles = [load_profile(DATA / f) for f in ("resnet-default.csv", "inception-default.csv", "gpt2-default.csv")]
    runs = []
    for _ in range(args.repeat):
        knapsack._solve_realizable.cache_clear()
        demands = []
        for i, batch in enumerate(BATCHES):
            prof = profiles[i % 3]
            most = max(p.batch for p in prof.points)

            def predict(c: int, prof=prof, batch=batch, most=most) -> float | None:
                try:
                    return realizable_plan(prof, c, min(batch, c * most)).predicted_latency_ms
                except PackratError:
                    return None
            demands.append(Demand(f"m{i}-{prof.model_id}-B{batch}", batch, predict))
        t0 = time.perf_counter()
        division = divide_cores(demands, range(args.cores))
        runs.append(time.perf_counter() - t0)
    json.dump({
        "cpu": describe_machine().cpu, "loadavg": os.getloadavg(), "command": " ".join(["scripts/bench_share.py", *sys.argv[1:]]),
        "models": len(BATCHES), "cores": args.cores, "batches": BATCHES,
        "seconds": [round(x, 4) for x in runs], "max_s": round(max(runs), 4),
        "division": {m: len(c) for m, c in division.shares.items()},
        "predicted_ms": {m: round(v, 2) for m, v in division.predicted_ms.items()},
    }, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
