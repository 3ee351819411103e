#!/usr/bin/env python
"""Kill -9 the fork server and the controller of a running `make run` under load (with
--kill-frontend-at, TorchServe's frontend too), then swap (packrat.bench.fault_drill): what
was lost, and when each part came back.

    make run    # and wait until `packrat status` shows the models applied
    python scripts/drill_faults.py --model resnet50 --payload .packrat/demo.jpg \
        --content-type image/jpeg --name resnet50-avx2-epyc

Writes docs/benchmarks/fault-drill-<name>.md (the machine named) and its .json (every request).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from packrat.bench.fault_drill import Drill, run_drill, write

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--payload", type=Path, required=True, help="the request body, a file")
    ap.add_argument("--content-type", default="application/octet-stream")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--swap-model", default="noop", help="the model a plan is applied to afterwards")
    ap.add_argument("--kill-frontend-at", type=float, default=None,
                    help="also kill TorchServe's frontend (the JVM) at this many seconds")
    ap.add_argument("--state-dir", type=Path, default=ROOT / ".packrat", help="make run's state directory")
    ap.add_argument("--name", required=True, help="file stem: fault-drill-<name>")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()
    drill = Drill(workdir=args.state_dir / "torchserve", controller_pid_file=args.state_dir / "controller.pid",
                  controller_url=(args.state_dir / "controller.url").read_text().strip(), model=args.model,
                  payload=args.payload.read_bytes(), content_type=args.content_type, swap_model=args.swap_model,
                  clients=args.clients, seconds=args.seconds, frontend_kill_at=args.kill_frontend_at,
                  command="python " + " ".join(shlex.quote(a) for a in sys.argv))
    try:
        record = run_drill(drill)
    except RuntimeError as exc:
        ap.error(str(exc))
    print(write(record, drill, args.out_dir, args.name).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
