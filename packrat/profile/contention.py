"""Points timed while other work shared their cores, and what a plan may take from them.

A re-profile runs while the model serves (packrat.control.tuning.Reprofiler): the profile's
worker and the serving workers are pinned to the same few cores, so a point's wall time
holds the time its instance was runnable but another task had the core. Planned from
as it is, such a profile predicts the contention of its own measurement (a run on 2 cores
predicted BERT-base 1.7-2x slower than it then served: docs/benchmarks/traffic-shape-*).

Every worker records, per point, `cpu_share` (CPU time per wall second per thread) and
`runq_share` (the computing thread's run-queue wait per wall second, from
/proc/thread-self/schedstat). Then:

  - a one-thread point with runq_share >= TIME_SHARED_AT was time-shared: its figures
    are the wall figures times (1 - runq_share), the time it computed, and the wall
    figures stay in its meta ("contention": {"corrected": ..., "wall": ...}). For a
    compute-bound point that is wall x cpu_share; unlike cpu_share it does not count
    time spent sleeping or waiting for I/O as time saved (a handler that sleeps has
    cpu_share near 0 on a quiet machine and no run-queue wait);
  - a point of more threads keeps its wall figures and is marked contended when its
    computing thread waited (runq_share), or its threads together did (`runq_share_all`:
    the run-queue wait of every thread of the process per wall second per thread asked):
    no corrected figure is defensible there (spin-waiting runtimes turn waits for a
    descheduled peer into CPU time, and one late thread holds every other). Getting less
    CPU than its threads ask (cpu_share < CPU_SHORT_OF) is no sign of it where the
    threads' wait is known: GPT-2's second thread idles between ops on a quiet machine
    (cpu_share 0.88), a sleeping handler's at 0.5; it decides only for points recorded
    without runq_share_all (older profiles);
  - either applies only when other processes had the point's cores (`others_share`, their
    CPU time there per wall second per core, >= OTHERS_AT; unknown in older profiles): a
    runtime that starts more threads than its slot's (OpenVINO at two threads waited 16-19 %
    of the time on a quiet machine) waits on itself, as it will when it serves;
  - a co-run point (instances side by side, the slowest sets it) is made from its
    instances' figures after each was handled so.

The profile says which points were corrected and which are contended (summary(), its
"contention" key). Pure: no clock, no files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from packrat.types import ProfilePoint

TIME_SHARED_AT = 0.10  # run-queue wait per wall second from which a point counts as time-shared
CPU_SHORT_OF = 0.90  # a multi-thread point below this cpu_share got less CPU than its threads ask
OTHERS_AT = 0.10  # other processes' CPU time on the point's cores per wall second per core, from which
# its wait was theirs; below it the point waited on its own threads (a runtime starting more
# threads than the slot's), which serving it costs too: nothing to correct or re-measure
FIGURES = ("mean_ms", "p50_ms", "p99_ms", "std_ms")
CORRECTED = "one thread, time-shared: figures x (1 - runq_share), the time it computed"
CONTENDED = "several threads, contended: wall figures kept (no defensible correction)"


def handled(fields: Mapping[str, Any], threads: int) -> dict[str, Any]:
    """A worker's point fields (FIGURES and "meta", as its "point" event carries them) with
    its contention handled as the module doc says; unchanged when it had its cores."""
    out = dict(fields)
    meta = dict(fields.get("meta") or {})
    wait, share, wait_all = meta.get("runq_share"), meta.get("cpu_share"), meta.get("runq_share_all")
    others = meta.get("others_share")
    external = others is None or others >= OTHERS_AT  # unknown (older profiles): as if others
    waited = wait is not None and wait >= TIME_SHARED_AT and external
    starved = external and (wait_all >= TIME_SHARED_AT if wait_all is not None
                            else share is not None and share < CPU_SHORT_OF)
    if threads == 1 and waited:
        keep = 1.0 - float(wait)
        wall = {k: fields[k] for k in FIGURES if fields.get(k) is not None}
        out.update({k: v * keep for k, v in wall.items()})
        meta["contention"] = {"corrected": CORRECTED, "factor": round(keep, 4), "wall": wall}
    elif threads > 1 and (waited or starved):
        meta["contention"] = {"contended": CONTENDED}
    else:
        return out
    out["meta"] = meta
    return out


def state(point: ProfilePoint | Mapping[str, Any]) -> str | None:
    """"corrected", "contended" or None (had its cores) for a point handled above."""
    meta = point.meta if isinstance(point, ProfilePoint) else (point.get("meta") or {})
    found = meta.get("contention") or {}
    return "corrected" if "corrected" in found else "contended" if "contended" in found else None


def corun_contention(rows: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The co-run point's "contention" meta from its instances' handled rows (None: none had
    any): corrected when any instance was, with the wall figure the slowest instance had."""
    states = [state(r) for r in rows]
    if not any(states):
        return None
    walls = [((r.get("meta") or {}).get("contention") or {}).get("wall", {}).get("mean_ms", r["mean_ms"])
             for r in rows]
    kind = "corrected" if "corrected" in states else "contended"
    return {kind: CORRECTED if kind == "corrected" else CONTENDED, "per_instance": states,
            "wall": {"mean_ms": max(walls)}}


def summary(points: Iterable[ProfilePoint], corun: Iterable[ProfilePoint] = ()) -> dict[str, Any] | None:
    """The profile's "contention" key: which points (instances, threads, batch) were
    corrected and which are contended, and the rule; None when every point had its cores."""
    found: dict[str, list[list[int]]] = {"corrected": [], "contended": []}
    for p in (*points, *corun):
        s = state(p)
        if s is not None:
            found[s].append([p.instances, p.threads, p.batch])
    if not any(found.values()):
        return None
    return {**found, "rule": {"corrected": CORRECTED, "contended": CONTENDED,
                              "time_shared_at_runq_share": TIME_SHARED_AT, "cpu_short_of": CPU_SHORT_OF,
                              "others_at": OTHERS_AT}}
