"""CPU time of named processes over a window, read from /proc/<pid>/stat.

utime + stime of a process's stat covers all of its threads, those that already
exited included, so a window's figure is the difference of two readings. The
kernel counts in clock ticks (usually 10 ms): a window should hold many
requests for the per-request figure to mean anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from packrat.apply.swap import proc_cpu_ticks, stat_cpu_ticks


def tick_ms() -> float:
    return 1000.0 / os.sysconf("SC_CLK_TCK")


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def command_name(pid: int) -> str:
    """What a process runs, briefly: the module of `python -m MODULE`, else its program's name."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return comm(pid)
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1]
    # e.g. the fork server's shim, TorchServe's `python` for a worker: python .../model_service_worker.py
    script = next((Path(a).name for a in args[1:] if a.endswith(".py")), None)
    return " ".join(filter(None, [Path(args[0]).name or comm(pid), script]))


def pids() -> list[int]:
    """Every process's id, as /proc lists them now."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def all_cpu_ticks() -> dict[int, int]:
    """pid -> utime + stime ticks, for every process still there when its stat is read."""
    return {pid: t for pid in pids() if (t := proc_cpu_ticks(pid)) is not None}


# HotSpot names its JIT compiler threads so (the kernel keeps 15 characters of a name).
JIT_THREAD_PREFIXES = ("C1 CompilerThre", "C2 CompilerThre")


def jit_cpu_ticks(pid: int) -> int | None:
    """utime + stime of the JVM `pid`'s JIT compiler threads alive now (None: no such process).
    HotSpot starts and stops extra compiler threads as its queue needs; the ticks of one that
    exited are no longer counted, so a window's difference is a lower bound."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        read = stat_cpu_ticks(f"/proc/{pid}/task/{tid}/stat")  # None: exited meanwhile
        if read and read[0].startswith(JIT_THREAD_PREFIXES):
            total += read[1]
    return total


def _live_where(field: int, value: int) -> list[int]:
    """Live (not zombie) processes whose /proc/<pid>/stat field after "(comm)" number
    `field` (1: ppid, 2: pgrp) is `value`."""
    out = []
    for pid in pids():
        try:
            rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(rest[field]) == value and rest[0] != "Z":
            out.append(pid)
    return sorted(out)


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a TorchServe started by packrat.server leads one)."""
    return _live_where(2, pgid)


def children_of(parent: int) -> list[int]:
    """Live direct children of `parent` (a controller run with --restart-on-crash is one)."""
    return _live_where(1, parent)


def controller_labels(pid: int) -> dict[int, str]:
    """pid -> label for a controller named by its pid: the pid `make run` keeps is the
    supervisor of `packrat controller --restart-on-crash`, which runs the controller as its child."""
    try:
        supervised = b"--restart-on-crash" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        supervised = False
    if not supervised:
        return {pid: "controller"}
    labels = {pid: "controller's supervisor (--restart-on-crash)"}
    for child in children_of(pid):
        labels[child] = "controller"
    return labels


@dataclass(frozen=True)
class CpuWindow:
    """CPU milliseconds each labelled process used between start() and stop()."""

    labels: dict[int, str]  # pid -> what it is ("frontend JVM", "worker 1", ...)
    before: dict[int, int]  # pid -> ticks at the start

    @classmethod
    def start(cls, labels: dict[int, str]) -> CpuWindow:
        before = {pid: t for pid in labels if (t := proc_cpu_ticks(pid)) is not None}
        return cls(labels, before)

    def stop(self) -> dict[str, dict[str, float | int | None]]:
        """label -> {"pid", "cpu_ms"}; cpu_ms None when the process was gone at either end."""
        out: dict[str, dict[str, float | int | None]] = {}
        for pid, label in self.labels.items():
            after = proc_cpu_ticks(pid)
            used = None if after is None or pid not in self.before else (after - self.before[pid]) * tick_ms()
            out[label] = {"pid": pid, "cpu_ms": None if used is None else round(used, 1)}
        return out
