"""Which machine a benchmark ran on: one description for every results file."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

from packrat.profile.fingerprint import cpu_model

# The instruction sets the execution modes care about (bf16, int8, AMX): docs/modes.md.
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Machine:
    cpu: str  # the CPU's model name
    flags: tuple[str, ...]  # which of FLAGS_OF_INTEREST it has
    cores: int  # CPUs this process may run on (its affinity)
    cpus: int  # CPUs the kernel reports (os.cpu_count())
    memory_gib: float
    python: str

    def as_dict(self) -> dict:
        return {**asdict(self), "flags": list(self.flags)}


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """FLAGS_OF_INTEREST the first CPU in /proc/cpuinfo (or the given text) lists."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ()
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return tuple(f for f in FLAGS_OF_INTEREST if f in have)


def memory_gib() -> float:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


def describe_machine() -> Machine:
    return Machine(cpu=cpu_model(), flags=cpu_flags(), cores=len(os.sched_getaffinity(0)),
                   cpus=os.cpu_count() or 0, memory_gib=memory_gib(), python=platform.python_version())
