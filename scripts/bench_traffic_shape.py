#!/usr/bin/env python
"""Predicted against observed latency for <= 8-token and ~128-token texts (issue 32, target 3):
8 closed-loop clients, `packrat controller --no-tune` beside a private TorchServe, rounds of
A (short texts) then B (long texts), each phase measured once the controller has settled for
its traffic. See packrat/bench/traffic_shape.py for what is compared with what.

    python scripts/bench_traffic_shape.py --name bert-base                # builds bert-base fp32-eager
    python scripts/bench_traffic_shape.py --name bert-base-int8 --precision int8 --runtime onnxruntime
    python scripts/bench_traffic_shape.py --model-dir STORE/bert-base --profile bert128.json --name x

Writes <out-dir>/traffic-shape-<name>.jsonl (records as measured) and traffic-shape-<name>.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from packrat.bench.paths import RESULTS
from packrat.bench.results import read_records
from packrat.bench.traffic_shape import SETTLE_TIMEOUT_S, Options, built_archive, plot, render, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, help="file stem: traffic-shape-<name>")
    ap.add_argument("--model-dir", type=Path, default=None, help="a text archive (default: build --arch)")
    ap.add_argument("--arch", default="bert-base", help="architecture to build without --model-dir")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--runtime", default="eager")
    ap.add_argument("--store", type=Path, default=Path("bench-out/traffic-shape-store"))
    ap.add_argument("--profile", type=Path, default=None,
                    help="start profile (its settings must name sizes); default: measured at 128 tokens")
    ap.add_argument("--profile-budget-s", type=float, default=120.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--hold-s", type=float, default=10.0, help="settled this long before the window")
    ap.add_argument("--settle-timeout-s", type=float, default=SETTLE_TIMEOUT_S)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--attach", type=Path, default=None,
                    help="workdir of a running TorchServe (packrat torchserve start) to serve on, "
                         "instead of a private one")
    args = ap.parse_args()
    out = args.out_dir / f"traffic-shape-{args.name}.jsonl"
    if out.exists():
        ap.error(f"{out} exists: choose another --name (results are appended, never mixed)")
    opts = Options(model_dir=args.model_dir or built_archive(args.arch, args.store, args.precision, args.runtime), out_jsonl=out, start_profile=args.profile, rounds=args.rounds,
                   clients=args.clients, window_s=args.window_s, settle_timeout_s=args.settle_timeout_s,
                   hold_s=args.hold_s, profile_budget_s=args.profile_budget_s, attach=args.attach,
                   command="python " + " ".join(shlex.quote(a) for a in sys.argv))
    started = time.time()
    rows = run(opts)
    records = list(read_records(out))
    out.with_suffix(".md").write_text(render(records, (started, time.time()), out.with_suffix(".png").name))
    plot(records, out.with_suffix(".png"))
    for row in rows:
        print({k: row[k] for k in ("round", "phase", "ratio", "service_ratio", "settled", "swaps", "failed")})
    print(f"wrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
