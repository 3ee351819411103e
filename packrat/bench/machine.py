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
    family_model: str = ""  # "family 25 model 1", where /proc/cpuinfo says

    @property
    def label(self) -> str:
        """The CPU as results files name it: a VM's model name is often only the vendor's line
        ("AMD EPYC" for a Zen 3 with AVX2 alone and for a Zen 4 with AVX-512), and figures
        from the two must not be compared, so the family, model and instruction sets follow."""
        detail = "; ".join(x for x in (self.family_model, isa_summary(self.flags)) if x)
        return f"{self.cpu} ({detail})" if detail else self.cpu

    def as_dict(self) -> dict:
        return {**asdict(self), "flags": list(self.flags), "label": self.label}


def isa_summary(flags: tuple[str, ...] | list[str]) -> str:
    """What the execution modes care about, in a few words (docs/modes.md)."""
    have = set(flags)
    if "amx_tile" in have or "amx_bf16" in have or "amx_int8" in have:
        parts = ["AMX"] + [f for f in ("amx_bf16", "amx_int8") if f in have]
    elif "avx512f" in have:
        parts = ["AVX-512"] + [f for f in ("avx512_vnni", "avx512_bf16") if f in have]
    elif "avx2" in have:
        parts = ["avx2", "no AVX-512"]
    else:
        return "no AVX2"
    return ", ".join(parts)


def family_model(cpuinfo: str) -> str:
    """"family F model M" of the first CPU in /proc/cpuinfo's text, or ""."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first CPU's block only
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    fam, model = fields.get("cpu family", ""), fields.get("model", "")
    return f"family {fam} model {model}" if fam and model else ""


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text ("" where there is none), read once per description."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str) -> tuple[str, ...]:
    """FLAGS_OF_INTEREST the first CPU in /proc/cpuinfo's text lists."""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return tuple(f for f in FLAGS_OF_INTEREST if f in have)


def memory_gib() -> float:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


def describe_machine() -> Machine:
    cpuinfo = read_cpuinfo()
    return Machine(cpu=cpu_model(), flags=cpu_flags(cpuinfo), cores=len(os.sched_getaffinity(0)),
                   cpus=os.cpu_count() or 0, memory_gib=memory_gib(), python=platform.python_version(),
                   family_model=family_model(cpuinfo))
