"""Isolated versus co-run prediction gap, from one `packrat bench` run.

    python scripts/corun_gap.py bench-out/quick > docs/benchmarks/corun-gap.md

For every measured plan shape of the run (fat, the oracle's uniform shapes, packrat's),
the same profile predicts its latency twice: from the isolated figures alone (the
profile with its co-run points removed, as every profile was before co-run profiling)
and with the co-run figures (Profile.instance_latency). Both are compared with what
TorchServe measured: its worker time (mean inference minus queue time per request:
the part a profile can predict) and the client's p50 (which adds HTTP and queueing).
gap = measured / predicted - 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from packrat.bench.report import server
from packrat.bench.results import read_measurements, read_records
from packrat.plan import plan_latency_at, plan_from_shape
from packrat.profile import load_profile


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f} %"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the `packrat bench` output directory (holds results.jsonl)")
    out = ap.parse_args().out
    run = next((r for r in read_records(out / "results.jsonl") if r.get("kind") == "run"), {})
    lines = [f"Run: `{run.get('command', '?')}`; machine: {json.dumps(run.get('machine', {}))}", "",
             "| model | B | config | shape | isolated ms | co-run ms | worker ms | worker gap isolated | "
             "worker gap co-run | p50 ms | p50 gap isolated | p50 gap co-run |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst = {"isolated": 0.0, "co-run": 0.0}
    for m in read_measurements(out / "results.jsonl"):
        if m.config == "defaults" or not m.instances or not m.valid:
            continue
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
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"Largest |worker gap|: isolated {worst['isolated'] * 100:.1f} %, co-run {worst['co-run'] * 100:.1f} %."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
