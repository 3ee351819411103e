#!/usr/bin/env python3
"""Write one summary per machine from the results files in docs/benchmarks/.

    python scripts/benchmark_summary.py            # (re)write docs/benchmarks/machine-*.md
    python scripts/benchmark_summary.py --check    # exit 1 if a summary is not what it would write

A results file is a markdown file in docs/benchmarks/ that records one dated run.
Its header is either front matter

    ---
    date: 2026-12-04 11:30-11:43 UTC
    machine: AMD EPYC, 2 cores
    command: scripts/run_demo.sh (make run)
    figures: every demo model tuned and live 684 s (11.4 min) after make run started
    ---

or, for a `packrat bench` summary.md copied as it was written, its own lines
"Run `20261203T103328Z`: `packrat bench ...`" and "Machine: cpu AMD EPYC, ...,
usable_cores 2". The summaries are generated from those headers only; a run
is described in its results file, never in the summary (packrat.bench.summaries).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.paths import REPO, RESULTS
from packrat.bench.summaries import read_run, update

__all__ = ["main", "read_run"]  # tests/test_readme_figures.py reads results headers through this script


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    ap.add_argument("--dir", type=Path, default=RESULTS, help="results folder [docs/benchmarks]")
    args = ap.parse_args(argv)
    out_of_date = update(args.dir, args.check)
    if not args.check:
        return 0
    for p in out_of_date:
        print(f"out of date: {p.relative_to(REPO) if p.is_relative_to(REPO) else p}")
    return 1 if out_of_date else 0


if __name__ == "__main__":
    sys.exit(main())
