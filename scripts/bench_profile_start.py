#!/usr/bin/env python
"""Profiling with workers forked warm against workers started as new interpreters.

    .venv/bin/python scripts/bench_profile_start.py [--models resnet50,bert-base]
        [--mode fp32-eager] [--rounds 2] [--max-batch 8] [--point-budget 1.5] [--budget S]

Per round and model, `packrat profile` twice, PACKRAT_FORKSERVER=1 and =0 (the order
alternates between rounds), on the full-size demo archive (seeded weights, built into
bench-out/profile-start-store). Each run is a new `packrat profile` process, so the
forked runs pay their fork server's imports every time (a controller pays them once).
Reports wall time, each worker's asked-for -> ready time, and what was measured
(with --budget: how many points fit). Writes docs/benchmarks/profile-start.json (or
--out) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(archive: Path, mode: str, forked: bool, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        out = Path(tmp) / "profile.json"
        cmd = [sys.executable, "-m", "packrat.cli", "profile", str(archive), "--mode", mode,
               "--cores", str(len(os.sched_getaffinity(0))), "--max-batch", str(args.max_batch),
               "--point-budget", str(args.point_budget), "-q", "-o", str(out)]
        if args.budget:
            cmd += ["--budget", str(args.budget)]
        env = {**os.environ, "PACKRAT_FORKSERVER": "1" if forked else "0"}
        started = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.monotonic() - started
        if proc.returncode != 0:
            raise SystemExit(f"packrat profile failed: {proc.stderr[-2000:]}")
        data = json.loads(out.read_text())
    return {"forked": forked, "wall_s": round(wall, 2), "duration_s": data.get("duration_s"),
            "workers": [{k: w.get(k) for k in ("threads", "forked", "ready_s", "load_s")} for w in data["workers"]],
            "points": len(data["points"]), "corun_points": len(data.get("corun", [])),
            "omitted": len(data.get("omitted", [])), "loadavg": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--mode", default="fp32-eager")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--point-budget", type=float, default=1.5)
    ap.add_argument("--budget", type=float, default=None, help="whole-run budget per profile (default none)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "profile-start.json")
    args = ap.parse_args()

    from packrat.archive import build_named
    from packrat.bench.machine import describe_machine

    store = REPO / "bench-out" / "profile-start-store"
    store.mkdir(parents=True, exist_ok=True)
    result = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": describe_machine().cpu,
              "cpus": len(os.sched_getaffinity(0)), "command": "scripts/bench_profile_start.py " + " ".join(sys.argv[1:]),
              "loadavg_before": os.getloadavg(), "runs": []}
    for model in args.models.split(","):
        archive = build_named(model, store, reuse_current=True)
        for r in range(args.rounds):
            for forked in ((True, False) if r % 2 == 0 else (False, True)):
                row = {"model": model, "mode": args.mode, "round": r, **run(archive, args.mode, forked, args)}
                print(json.dumps(row), file=sys.stderr, flush=True)
                result["runs"].append(row)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    result["loadavg_after"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"\n{result['cpu']}, {result['cpus']} CPUs, {result['when']}, `{result['command']}`\n")
    print("| model | workers | runs | wall s (each) | asked-for -> ready s per worker (median) | points + co-run points |")
    print("|---|---|---:|---|---:|---|")
    for model in args.models.split(","):
        for forked in (True, False):
            rows = [x for x in result["runs"] if x["model"] == model and x["forked"] == forked]
            ready = [w["ready_s"] for x in rows for w in x["workers"] if w.get("ready_s") is not None]
            print(f"| {model} | {'forked' if forked else 'new interpreter'} | {len(rows)} | "
                  f"{', '.join(str(x['wall_s']) for x in rows)} | "
                  f"{statistics.median(ready) if ready else 'n/a'} | "
                  f"{', '.join(str(x['points']) + ' + ' + str(x['corun_points']) for x in rows)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
