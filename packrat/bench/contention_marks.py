"""Whether the profiler tells a busy machine from a quiet one: each (archive, mode) profiled
alone and beside one busy loop per core, interleaved over rounds, every point's figures and
its contention mark (packrat.profile.contention) side by side.

A mark on a quiet run is a false alarm (a tune would measure the mode again for nothing:
packrat.control.tuning.why_busy); a busy run's several-thread point left unmarked is a
miss (its inflated figures would be planned from). One JSON object per point in
<out>.jsonl; render() writes <out>.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from packrat.bench.machine import describe_machine
from packrat.profile import ProfileSettings, open_archive, run_profile
from packrat.profile.contention import state
from packrat.profile.identity import archive_in_mode

ARMS = ("quiet", "busy")
META = ("cpu_share", "runq_share", "runq_share_all", "others_share")


@contextmanager
def busy_loops(cores: Sequence[int]) -> Iterator[None]:
    """One spinning Python process pinned to each core (a build or a test run beside it)."""
    procs = [subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{c}}})\nwhile True: pass"])
             for c in cores]
    try:
        time.sleep(0.5)  # running before the first point
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def profile_points(archive: Path, mode: str, cores: int, max_batch: int, point_budget_s: float) -> list[dict[str, Any]]:
    """Every point of one profile (solo and co-run) as a flat row."""
    ref = archive_in_mode(open_archive(archive), mode)
    prof = run_profile(ref, ProfileSettings(cores=cores, max_batch=max_batch, point_budget_s=point_budget_s),
                       progress=False)
    return [{"instances": p.instances, "threads": p.threads, "batch": p.batch, "mean_ms": round(p.mean_ms, 3),
             "mark": state(p), **{k: p.meta.get(k) for k in META}} for p in (*prof.points, *prof.corun)]


def run(out: Path, command: str, targets: Sequence[tuple[Path, str]], rounds: int, max_batch: int,
        point_budget_s: float) -> str:
    cores = sorted(os.sched_getaffinity(0))
    machine = describe_machine()
    rows: list[dict[str, Any]] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".jsonl"), "w") as f:
        for r in range(1, rounds + 1):
            for archive, mode in targets:
                for arm in (ARMS if r % 2 else ARMS[::-1]):  # quiet first in odd rounds
                    started = time.time()
                    with busy_loops(cores) if arm == "busy" else nullcontext():
                        points = profile_points(archive, mode, len(cores), max_batch, point_budget_s)
                    for p in points:
                        row = {"round": r, "model": archive.name, "mode": mode, "arm": arm, "started": started, **p}
                        rows.append(row)
                        f.write(json.dumps(row) + "\n")
                    f.flush()
    text = render(rows, f"{machine.label}, {machine.cores} cores", command)
    out.with_suffix(".md").write_text(text)
    return text


def render(rows: list[dict[str, Any]], machine: str, command: str) -> str:
    lines = [f"machine: {machine}", f"command: {command}", "",
             "| model, mode | arm | points | several-thread points marked contended | one-thread points (solo and co-run) corrected "
             "| others' share of the cores (median) | several-thread mean ms, busy / quiet (median) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["model"], r["mode"]) for r in rows})
    for model, mode in keys:
        mine = [r for r in rows if r["model"] == model and r["mode"] == mode]
        quiet = {(r["round"], r["instances"], r["threads"], r["batch"]): r["mean_ms"] for r in mine if r["arm"] == "quiet"}
        for arm in ARMS:
            got = [r for r in mine if r["arm"] == arm]
            several = [r for r in got if r["threads"] > 1]
            single = [r for r in got if r["threads"] == 1]
            others = sorted(r["others_share"] for r in got if r["others_share"] is not None)
            ratio = sorted(r["mean_ms"] / quiet[k] for r in several
                           if (k := (r["round"], r["instances"], r["threads"], r["batch"])) in quiet and quiet[k] > 0)
            median_others = f"{others[len(others) // 2]:.3f}" if others else "-"
            median_ratio = f"{ratio[len(ratio) // 2]:.2f}" if (ratio and arm == "busy") else "-"
            lines.append(f"| {model} {mode} | {arm} | {len(got)} | "
                         f"{sum(r['mark'] == 'contended' for r in several)} of {len(several)} | "
                         f"{sum(r['mark'] == 'corrected' for r in single)} of {len(single)} | "
                         f"{median_others} | {median_ratio} |")
    return "\n".join(lines) + "\n"
