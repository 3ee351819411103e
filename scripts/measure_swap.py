#!/usr/bin/env python
"""Measure live swaps: duration, phases, and p50/p99 during a swap vs steady state.

    .venv/bin/python scripts/measure_swap.py [--model minilm] [--swaps 4] [--clients 8]

Builds the model's archive into a scratch store (bench-out/swap-store), starts
TorchServe on free loopback ports (token auth on), registers it, and keeps
`clients` closed-loop clients running while the plan alternates between
2 x (1 thread) and 1 x (2 threads) `swaps` times, with `--steady` seconds of
unchanged serving between swaps. Every answer is checked against the answer
the same text got before the first swap.

Latency windows (request start times, monotonic clock):
  swap    the request overlapped [swap start, swap end]
  steady  the request lay wholly outside every swap window, after warm-up
Each plan's steady state is reported separately, since 1x2 and 2x1 differ.

Results: bench-out/swap-measure.json (raw per-swap records + summaries) and a
markdown table on stdout (pasted into docs/live-plans.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.paths import BENCH_OUT
from packrat.bench.swap_measure import measure_swap, report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="minilm", help="minilm | tiny-bert | noop | bert-base ...")
    ap.add_argument("--swaps", type=int, default=4)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steady", type=float, default=15.0, help="seconds of steady serving between swaps")
    ap.add_argument("--out", type=Path, default=BENCH_OUT / "swap-measure.json")
    args = ap.parse_args()
    result = measure_swap(args.model, args.swaps, args.clients, args.steady, args.out)
    print(report(result))
    return 0 if result["all"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
