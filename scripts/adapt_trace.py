#!/usr/bin/env python
"""Trace the re-plan loop through load steps: docs/adaptation.{png,md}.

Runs a private TorchServe (token auth on) with the table-latency test model
(tests/data/observe/sleepmodel: each batch sleeps L(threads, batch) ms, and
its profile is that table), starts on the plan for one client, and drives a
closed-loop load that steps 1 -> 8 -> 2 clients while the controller's
AdaptiveLoop ticks every second. Everything measured is saved first
(docs/benchmarks/adaptation-trace.json); the figure and the markdown are rendered from
that file only (`--from-trace` re-renders without running anything).

    python scripts/adapt_trace.py                  # run (~3 min) and render
    python scripts/adapt_trace.py --from-trace     # render the saved trace again
    python scripts/adapt_trace.py --model-dir STORE/minilm --profile minilm.json \
        --body-file text.txt --out adaptation-minilm    # a real archive instead
"""

from __future__ import annotations

import argparse
from pathlib import Path

from packrat.bench.adapt_trace import trace_and_render


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="1:30,8:60,2:60", help="clients:seconds,...")
    ap.add_argument("--min-dwell", type=float, default=20.0)
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="a Packrat archive directory to trace instead of the sleep model")
    ap.add_argument("--profile", type=Path, default=None, help="its profile (with --model-dir)")
    ap.add_argument("--body-file", type=Path, default=None, help="request body (with --model-dir)")
    ap.add_argument("--out", default="adaptation", help="docs/<out>.png, .md; docs/benchmarks/<out>-trace.json")
    ap.add_argument("--from-trace", action="store_true", help="render docs from the saved trace only")
    args = ap.parse_args()
    if (args.model_dir is None) != (args.profile is None):
        ap.error("--model-dir and --profile go together")
    body = args.body_file.read_bytes() if args.body_file and not args.from_trace else b"x"
    for row in trace_and_render(args.out, args.from_trace, args.steps, args.min_dwell, args.model_dir,
                                args.profile, body):
        print(row)


if __name__ == "__main__":
    main()
