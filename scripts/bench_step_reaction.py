#!/usr/bin/env python
"""Step-load benchmark (issue 32 item 2): time from a load step to the right plan live,
throughput in the first 10 / 30 / 60 s after the step against the settled figure, swaps
and failed requests, with the controller running as users run it (a private TorchServe on
loopback, the default re-plan loop). See packrat/bench/step_reaction.py for the figures.

Scenarios: `one` (one model, 1 -> 8 -> 1 -> 8 clients), `two` (two models, 8 clients
moving from the first to the second and back), `alternate` (two models, 8 clients moving
from one to the other every --phase-s, default 5 s, for --duration, default 300 s: swaps
per model per minute and the cores each had against its share while loaded). Without --model-dir the table-latency sleep
model serves (plans known exactly, no CPU work); with it, real archives and the profiles
measured on this machine (one per model, in order).

    python scripts/bench_step_reaction.py --scenario one --phase-s 90
    python scripts/bench_step_reaction.py --scenario two --model-dir STORE/minilm \
        --profile minilm.json --body-file text.txt --model-dir STORE/resnet50 \
        --profile resnet50.json --body-file cat.jpg --out step-two-real
    python scripts/bench_step_reaction.py --scenario alternate --out step-alternate-sleep
    python scripts/bench_step_reaction.py --scenario one --from-trace   # re-render only

Writes docs/benchmarks/<out>-trace.json (first), <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from packrat.bench.step_reaction import ALTERNATE_DURATION_S, ALTERNATE_PHASE_S
from packrat.bench.step_report import trace_and_render


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=("one", "two", "alternate"), default="one")
    ap.add_argument("--phase-s", type=float, default=None,
                    help=f"seconds per phase (default 90; alternate: {ALTERNATE_PHASE_S:g})")
    ap.add_argument("--duration", type=float, default=ALTERNATE_DURATION_S,
                    help="alternate: seconds of load in all (phases: duration / phase-s)")
    ap.add_argument("--settled-s", type=float, default=30.0,
                    help="the settled figure: the phase's last N s (at most half the phase)")
    ap.add_argument("--model-dir", type=Path, action="append", default=[], help="an archive directory (repeat)")
    ap.add_argument("--profile", type=Path, action="append", default=[], help="its profile (repeat, in order)")
    ap.add_argument("--body-file", type=Path, action="append", default=[], help="its request body (repeat)")
    ap.add_argument("--out", default=None, help="file stem (default step-<scenario>)")
    ap.add_argument("--from-trace", action="store_true", help="render from the saved trace only")
    args = ap.parse_args()
    if not (len(args.model_dir) == len(args.profile) == len(args.body_file)):
        ap.error("--model-dir, --profile and --body-file go together, once per model")
    bodies = [p.read_bytes() for p in args.body_file] if not args.from_trace else []
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    phase_s = args.phase_s or (ALTERNATE_PHASE_S if args.scenario == "alternate" else 90.0)
    rows = trace_and_render(args.out or f"step-{args.scenario}", args.scenario, phase_s, args.settled_s,
                            args.from_trace, args.model_dir, args.profile, bodies, command,
                            duration_s=args.duration)
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
