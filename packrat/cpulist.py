"""The kernel's CPU list format ("0-2,5"), as /proc/<pid>/status and cgroup files write it.

Beneath both packrat.slots (the worker side) and packrat.cores (usable cores):
reading a CPU list needs nothing else.
"""

from __future__ import annotations


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-2,5' -> (0, 1, 2, 5): the kernel's list format (Cpus_allowed_list)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def cpus_allowed_list(status_path: str = "/proc/self/status") -> str:
    """The kernel's Cpus_allowed_list of a process or thread, e.g. "0-1,4"."""
    with open(status_path) as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return "?"
