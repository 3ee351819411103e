#!/usr/bin/env python
"""Swap times and latency during swaps, per model and execution mode, cold and warm cache.

    .venv/bin/python scripts/bench_swaps.py [--models resnet50,bert-base]
        [--modes fp32-eager,bf16-openvino] [--swaps 5] [--clients 8] [--steady 8]

Builds the full-size demo archives (seeded random weights, as `packrat archive`
does) into bench-out/swaps-store, starts one TorchServe on free loopback ports
(token auth on) and, per model, registers the plain archive (1 worker), then per
mode, with `clients` closed-loop clients sending requests throughout:

  cold   the build cache (bench-out/swaps-store/.packrat-build-cache) is emptied,
         then a swap into the mode as 2 x (1 thread): it exports, compiles, guards
  cold2  a swap to 1 x (2 threads): the ONNX file and the guard verdict are cached,
         OpenVINO's compiled blob for 2 threads is not yet
  warm   `swaps` swaps alternating 2 x (1 thread) <-> 1 x (2 threads), everything cached,
         with `steady` seconds of unchanged serving before and between them

A swap's time is reported two ways: `live_s`, from the apply call until
set-default made the new version live (how the issue times a swap), and
`duration_s`, until the old version is drained and unregistered. Latency windows:
a request overlapping a warm swap's [start, end] counts as "during swaps", one
wholly outside every swap (and 3 s after the mode went live) as "steady".
Every answer is checked (label or top class the same as before the swaps).

Workers start through the fork server (packrat/forkserver) unless PACKRAT_FORKSERVER=0.

Writes docs/benchmarks/swaps.json (or --out): machine, command, load average
before and after, per (model, mode) the swap records and the summaries; prints a
markdown table (pasted into docs/live-plans.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.paths import RESULTS
from packrat.bench.swaps import measure_swaps, report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--modes", default="fp32-eager,bf16-openvino")
    ap.add_argument("--swaps", type=int, default=5)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steady", type=float, default=8.0, help="seconds of steady serving before/between swaps")
    ap.add_argument("--out", type=Path, default=RESULTS / "swaps.json")
    args = ap.parse_args()
    result = measure_swaps(args.models.split(","), args.modes.split(","), args.swaps, args.clients, args.steady,
                           args.out, "scripts/bench_swaps.py " + " ".join(sys.argv[1:]))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
