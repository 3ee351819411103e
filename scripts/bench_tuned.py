"""Tuned vs fat fp32-eager through TorchServe: the mode's gain and the shape's, in one run.

    python scripts/bench_tuned.py --models resnet50,bert-base --batch 8 --out bench-out/tuned

For each model (full-size architecture, seeded weights, built as `make run` builds it:
fp32 eager, batch 1) on its own TorchServe (token auth on) and an in-process
Packrat controller:

  1. fat-fp32-eager   1 worker, T threads, batch cap B, the archive's own mode
  2. tune             Controller.start_tune(batch=B): probe, guard + profile every
                      candidate mode, apply the best (mode, plan); timed from start
                      to applied, while requests keep arriving (--rate-during-tune,
                      every answer counted: failures during tuning are reported)
  3. tuned            what the tune made live
  4. fat-tuned-mode   1 worker, T threads, batch cap B, in the tuned mode
  5. tuned (again)    the repeat gives the run's noise band

each measured with B closed-loop keep-alive clients. One JSON object per line
in <out>/results.jsonl; a markdown summary is printed (and written to
<out>/summary.md).

`packrat bench --tuned` measures the same split (fat-tuned, tuned) at every B
of its run, beside fat, packrat, the oracle and the defaults
(docs/benchmarks.md); this script adds the load sent while tuning. Both use
packrat.bench.tuned (fat_plan, run_tune); the run is packrat.bench.tune_under_load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.tune_under_load import bench_tuned


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--requests", type=int, default=80, help="measured requests per point")
    ap.add_argument("--tune-budget", type=float, default=None, help="seconds per model tune [tune's default]")
    ap.add_argument("--modes", default="", help="comma-separated modes to try [tune's short list]")
    ap.add_argument("--out", type=Path, default=Path("bench-out/tuned"))
    ap.add_argument("--rate-during-tune", type=float, default=1.0, help="requests/s sent while tuning")
    args = ap.parse_args()
    print(bench_tuned([m for m in args.models.split(",") if m], args.batch, args.requests, args.tune_budget,
                      [m for m in args.modes.split(",") if m] or None, args.out, args.rate_during_tune,
                      " ".join(sys.argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
