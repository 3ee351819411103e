"""Isolated versus co-run prediction gap, from one `packrat bench` run (scripts/corun_gap.py
says what is compared): gap = measured / predicted - 1, per measured plan shape.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from packrat.bench.report import server
from packrat.bench.results import Measurement, read_measurements, read_records
from packrat.plan import plan_from_shape, plan_latency_at
from packrat.profile import load_profile


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f} %"


def gap_table(out: Path) -> str:
    """The markdown table for the `packrat bench` output directory `out` (its results.jsonl
    and profiles/<model>.json)."""
    run = next((r for r in read_records(out / "results.jsonl") if r.get("kind") == "run"), {})
    lines = [f"Run: `{run.get('command', '?')}`; machine: {json.dumps(run.get('machine', {}))}", "",
             "| model | B | config | shape | isolated ms | co-run ms | worker ms | worker gap isolated | "
             "worker gap co-run | p50 ms | p50 gap isolated | p50 gap co-run |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst = {"isolated": 0.0, "co-run": 0.0}
    for m in read_measurements(out / "results.jsonl"):
        if m.config == "defaults" or not m.instances or not m.valid:
            continue
        lines.append("| " + " | ".join(_row(out, m, worst)) + " |")
    lines += ["", f"Largest |worker gap|: isolated {worst['isolated'] * 100:.1f} %, co-run {worst['co-run'] * 100:.1f} %."]
    return "\n".join(lines)


def _row(out: Path, m: Measurement, worst: dict[str, float]) -> list[str]:
    prof = load_profile(out / "profiles" / f"{m.model}.json")
    iso = dataclasses.replace(prof, corun=())
    shape = [tuple(i) for i in m.instances]
    cores = sum(t for t, _ in shape)
    preds = {}
    for name, p in (("isolated", iso), ("co-run", prof)):
        plan = plan_from_shape(shape, cores, p)
        preds[name] = plan_latency_at(p, plan, m.batch)
    worker = server(m).get("worker_ms")
    row = [m.model, str(m.batch), m.config, m.shape,
           *("-" if not preds[k] else f"{preds[k]:.1f}" for k in ("isolated", "co-run")),
           "-" if worker is None else f"{worker:.1f}"]
    for base in (worker, m.p50):
        for name in ("isolated", "co-run"):
            g = None if (base is None or not preds[name]) else base / preds[name] - 1
            row.append(pct(g))
            if base is worker and g is not None:
                worst[name] = max(worst[name], abs(g))
        if base is worker:
            row.append("-" if m.p50 is None else f"{m.p50:.1f}")
    return row
