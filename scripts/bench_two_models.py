"""Two models under load at once on one machine: each planned for all cores (before cores
were divided among models) against the joint division (packrat.plan.share), side by side.

    python scripts/bench_two_models.py --models resnet50,bert-base --clients 4 --out bench-out/two-models

Both models (full-size architectures, seeded weights, fp32 eager, built as `make run`
builds them) run on one TorchServe (token auth on). Each round applies one
configuration to both models, then sends `--clients` closed-loop keep-alive clients to
each model at the same time for `--seconds` and records each model's p50/p99 and
throughput. Configurations, repeated `--rounds` times, in this order in even rounds and
in reverse in odd ones (so drift on a shared machine hits all of them alike):

  stacked-fat    each model 1 x (T threads, cap B) on every core: what a model planned
                 for all cores gets when its profile favours fat (both share every core)
  stacked-thin   each model T x (1 thread, cap ceil(B/T)) laid out from core 0: thin
                 plans of two models on the same cores
  divided        the division of cores when both have load: cores split between them
                 (on 2 cores one each), each model 1 x (its cores, cap B) on its own

The worst model's p50 per configuration is what the issue's target compares
(divided >= 1.5x better than the stacked plans). One JSON object per line in
<out>/results.jsonl; a markdown summary in <out>/summary.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.two_models import bench_two_models


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--clients", type=int, default=4, help="closed-loop clients per model (B)")
    ap.add_argument("--seconds", type=float, default=40.0, help="measured seconds per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench-out/two-models"))
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    if len(models) != 2:
        raise SystemExit("give two models")
    print(bench_two_models(models, args.clients, args.seconds, args.rounds, args.out, " ".join(sys.argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
