"""scripts/bench_contention_marks.py's parts: the busy loops it starts and stops, and its table's
counts (false alarms on quiet runs, misses on busy ones) from the points' marks."""

from __future__ import annotations

import os
import time

from packrat.bench.contention_marks import busy_loops, render
from packrat.cores import read_cpu_ticks


def _row(arm: str, threads: int, mark: str | None, mean: float, others: float, instances: int = 1) -> dict:
    return {"round": 1, "model": "m", "mode": "fp32-eager", "arm": arm, "instances": instances,
            "threads": threads, "batch": 2, "mean_ms": mean, "mark": mark, "others_share": others}


def test_the_table_counts_marks_per_arm_and_the_busy_inflation() -> None:
    rows = [_row("quiet", 1, None, 10.0, 0.0), _row("quiet", 2, None, 6.0, 0.01),
            _row("busy", 1, "corrected", 19.0, 0.9), _row("busy", 2, "contended", 12.0, 0.95),
            _row("busy", 1, None, 11.0, 0.8, instances=2)]
    text = render(rows, "a CPU, 2 cores", "cmd")
    quiet = next(line for line in text.splitlines() if "| quiet |" in line)
    busy = next(line for line in text.splitlines() if "| busy |" in line)
    assert "| 0 of 1 | 0 of 1 | 0.010 | - |" in quiet, quiet
    assert "| 1 of 1 | 1 of 2 | 0.900 | 2.00 |" in busy, busy  # 12 ms busy against 6 quiet


def test_busy_loops_load_every_core_while_they_run_and_stop() -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    with busy_loops(cores):
        before = read_cpu_ticks()
        time.sleep(1.0)
        after = read_cpu_ticks()
    idle = sum(after[c][0] - before[c][0] for c in cores) / max(1, sum(after[c][1] - before[c][1] for c in cores))
    assert idle < 0.3, idle  # about 0: each core spun by its loop
