"""Profiling with workers forked warm against workers started as new interpreters
(scripts/bench_profile_start.py says what is measured): `packrat profile` run twice per
round and model, PACKRAT_FORKSERVER=1 and =0, the order alternating between rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from packrat.bench.machine import describe_machine
from packrat.bench.paths import BENCH_OUT
from packrat import settings


@dataclass(frozen=True)
class ProfileRun:
    """What each `packrat profile` is asked for."""

    mode: str
    max_batch: int
    point_budget_s: float
    budget_s: float | None  # the whole run's budget (None: none)


def run(archive: Path, forked: bool, how: ProfileRun) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        out = Path(tmp) / "profile.json"
        cmd = [sys.executable, "-m", "packrat.cli", "profile", str(archive), "--mode", how.mode,
               "--cores", str(len(os.sched_getaffinity(0))), "--max-batch", str(how.max_batch),
               "--point-budget", str(how.point_budget_s), "-q", "-o", str(out)]
        if how.budget_s:
            cmd += ["--budget", str(how.budget_s)]
        env = {**os.environ, settings.get("forkserver").env: "1" if forked else "0"}
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


def bench_profile_start(models: list[str], rounds: int, how: ProfileRun, out: Path, command: str) -> dict:
    """Every model's rounds; the result is rewritten to `out` after each run and returned."""
    from packrat.archive import build_named

    store = BENCH_OUT / "profile-start-store"
    store.mkdir(parents=True, exist_ok=True)
    result = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": describe_machine().label,
              "cpus": len(os.sched_getaffinity(0)), "command": command,
              "loadavg_before": os.getloadavg(), "runs": []}
    for model in models:
        archive = build_named(model, store, reuse_current=True)
        for r in range(rounds):
            for forked in ((True, False) if r % 2 == 0 else (False, True)):
                row = {"model": model, "mode": how.mode, "round": r, **run(archive, forked, how)}
                print(json.dumps(row), file=sys.stderr, flush=True)
                result["runs"].append(row)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=1) + "\n")
    result["loadavg_after"] = os.getloadavg()
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def report(result: dict, models: list[str]) -> str:
    lines = [f"\n{result['cpu']}, {result['cpus']} CPUs, {result['when']}, `{result['command']}`\n",
             "| model | workers | runs | wall s (each) | asked-for -> ready s per worker (median) "
             "| points + co-run points |",
             "|---|---|---:|---|---:|---|"]
    for model in models:
        for forked in (True, False):
            rows = [x for x in result["runs"] if x["model"] == model and x["forked"] == forked]
            ready = [w["ready_s"] for x in rows for w in x["workers"] if w.get("ready_s") is not None]
            lines.append(f"| {model} | {'forked' if forked else 'new interpreter'} | {len(rows)} | "
                         f"{', '.join(str(x['wall_s']) for x in rows)} | "
                         f"{statistics.median(ready) if ready else 'n/a'} | "
                         f"{', '.join(str(x['points']) + ' + ' + str(x['corun_points']) for x in rows)} |")
    return "\n".join(lines)
