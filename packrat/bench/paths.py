"""Where the benchmarks read and write in this checkout (packrat is installed editable)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
RESULTS = DOCS / "benchmarks"  # dated results files, one summary per machine
BENCH_OUT = REPO / "bench-out"  # scratch stores and raw output, not committed
