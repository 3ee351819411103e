#!/usr/bin/env python
"""Two commits' serving cost side by side (packrat.bench.code_ab): the served level of
scripts/bench_efficiency.py in sessions A B B A, each from a git worktree of its commit,
and per window the throughput, p50 and the CPU a request of the workers and the JVM.

    python scripts/bench_code_ab.py --a 3adce48 --b HEAD --model bert-base \\
        --mode int8-onnxruntime --plan '2x(t1,b4)' --max-length 8 --name read-ahead-bert8

Writes docs/benchmarks/code-ab-<name>.jsonl (a line per window) and .md (the machine named).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from packrat.bench.code_ab import CodeAB, run

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="HEAD~1", help="commit A (the one before)")
    ap.add_argument("--b", default="HEAD", help="commit B")
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--mode", default="int8-onnxruntime")
    ap.add_argument("--plan", default="2x(t1,b4)")
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--warm-s", type=float, default=45.0)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--skip", type=int, default=1, help="windows at a session's start left out of the medians")
    ap.add_argument("--name", required=True, help="file stem: code-ab-<name>")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()
    opts = CodeAB(a=args.a, b=args.b, name=args.name, model=args.model, mode=args.mode, plan=args.plan,
                  max_length=args.max_length, warm_s=args.warm_s, windows=args.windows, window_s=args.window_s,
                  skip=args.skip, out_dir=args.out_dir, repo=ROOT,
                  command="python " + " ".join(shlex.quote(a) for a in sys.argv))
    try:
        md = run(opts)
    except (FileExistsError, RuntimeError) as exc:
        ap.error(str(exc))
    print(f"wrote {md.with_suffix('.jsonl')} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
