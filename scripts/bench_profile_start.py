#!/usr/bin/env python
"""Profiling with workers forked warm against workers started as new interpreters.

    .venv/bin/python scripts/bench_profile_start.py [--models resnet50,bert-base]
        [--mode fp32-eager] [--rounds 2] [--max-batch 8] [--point-budget 1.5] [--budget S]

Per round and model, `packrat profile` twice, PACKRAT_FORKSERVER=1 and =0 (the order
alternates between rounds), on the full-size demo archive (seeded weights, built into
bench-out/profile-start-store). Each run is a new `packrat profile` process, so the
forked runs pay their fork server's imports every time (a controller pays them once).
Reports wall time, each worker's asked-for -> ready time, and what was measured
(with --budget: how many points fit). Writes docs/benchmarks/profile-start.json (or
--out) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.paths import RESULTS
from packrat.bench.profile_start import ProfileRun, bench_profile_start, report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--mode", default="fp32-eager")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--point-budget", type=float, default=1.5)
    ap.add_argument("--budget", type=float, default=None, help="whole-run budget per profile (default none)")
    ap.add_argument("--out", type=Path, default=RESULTS / "profile-start.json")
    args = ap.parse_args()
    models = args.models.split(",")
    result = bench_profile_start(models, args.rounds, ProfileRun(args.mode, args.max_batch, args.point_budget,
                                                                 args.budget), args.out,
                                 "scripts/bench_profile_start.py " + " ".join(sys.argv[1:]))
    print(report(result, models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
