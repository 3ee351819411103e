#!/usr/bin/env python
"""Latency and throughput of each demo model through TorchServe: one client, batch 1.

Starts its own TorchServe (free loopback ports, token on, the repo's
config.properties) on the demo archives in model-store/ (build them with
`make run` or `packrat archive ...`), registers each model with one worker,
then per model: warm-up requests, then timed requests one after another from
one client (packrat.bench.loadgen's closed loop with one client, keep-alive). Reports p50/p99/mean latency and throughput,
plus the `noop` model: TorchServe's own round trip (HTTP, queue, worker
socket, Python handler) with no model at all.

    .venv/bin/python scripts/bench_serving.py --out docs/serving-benchmark.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

from packrat.bench.paths import REPO
from packrat.bench.serving import report_md, serve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-store", type=Path, default=REPO / "model-store")
    ap.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply every request count (0.2 for a smoke run)")
    args = ap.parse_args()
    info, rows, missing = serve(args.model_store, args.warmup, args.scale)
    if args.out:
        args.out.write_text(report_md(info, rows, missing, args.out, args.scale))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
