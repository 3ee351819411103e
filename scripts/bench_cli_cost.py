#!/usr/bin/env python
"""What one `packrat status` call costs, for two commits side by side (packrat.bench.cli_cost):
CPU and wall time per call against a stand-in controller answering five models, in rounds
A B B A, each commit from a git worktree of its own.

    python scripts/bench_cli_cost.py --a 32772dd --b HEAD --name status-urllib

Writes docs/benchmarks/cli-cost-<name>.md (the machine named).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from packrat.bench.cli_cost import CliCost, run

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="commit A (the one before)")
    ap.add_argument("--b", default="HEAD", help="commit B")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of A B B A")
    ap.add_argument("--name", required=True, help="file stem: cli-cost-<name>")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()
    opts = CliCost(a=args.a, b=args.b, name=args.name, rounds=args.rounds, out_dir=args.out_dir, repo=ROOT,
                   command="python " + " ".join(shlex.quote(a) for a in sys.argv))
    try:
        md = run(opts)
    except RuntimeError as exc:
        ap.error(str(exc))
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
