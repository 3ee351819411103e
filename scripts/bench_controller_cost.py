"""What the controller costs (issue 35 item 4): its CPU per wall second with five models
loaded, one under closed-loop load and four idle.

    python scripts/bench_controller_cost.py --clients 2 --seconds 60 --status-tab

A private TorchServe with five sleep models, `packrat controller` (re-planning on, tuning
off) and `--clients` closed-loop clients on the first model; with --status-tab also one
status-page tab (every model's status every 5 s). The controller's CPU time is read from
/proc/<pid>/stat over the window; the load average is printed beside it. Prints the JSON
record and a markdown row (docs/benchmarks/controller-cost-*.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from packrat.bench.controller_cost import measure, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=2, help="closed-loop clients on the loaded model")
    ap.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds of load before the window")
    ap.add_argument("--status-tab", action="store_true", help="poll every model's status every 5 s")
    ap.add_argument("--label", default="this tree", help="the row's label")
    args = ap.parse_args()
    rec = measure(args.clients, args.seconds, args.settle, args.status_tab, " ".join(sys.argv))
    print(json.dumps(rec))
    print(summary(rec, args.label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
