"""Usable cores: what this process may really run on, containers included.

    usable = sched_getaffinity(0) ∩ cgroup cpuset, then capped by the cgroup CPU quota

A pod limited to 4 CPUs on a 64-core node sees all 64 in its affinity; only its
cgroup says 4. Two limits can apply:

- cpuset (which cores): cgroup v2 `cpuset.cpus.effective`; v1 `cpuset.effective_cpus`
  (or `cpuset.cpus`). The kernel already applies it to the affinity, but a
  process whose affinity was set before it moved into the cgroup may still
  list more, so both are intersected.
- quota (how much time): v2 `cpu.max` ("<quota> <period>" or "max"); v1
  `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none). Every level from the
  process's cgroup up to the root can set one; the smallest counts. A quota
  of q cores keeps floor(q) cores, at least 1 (the first ones, in order): a
  plan for more threads than the quota would be throttled in every period.

`PACKRAT_CORES` (a CPU list such as "0-3,8") or an explicit override replaces
the lot. `UsableCores.reason` says what was found and why, for status output.

Pure file reading under `root` (tests point it at fixture trees).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from packrat import settings
from packrat.errors import ConfigError
from packrat.cpulist import parse_cpu_list

ENV_VAR = settings.get("cores").env


@dataclass(frozen=True)
class UsableCores:
    cores: tuple[int, ...]
    affinity: tuple[int, ...]
    cpuset: tuple[int, ...] | None  # None: no cgroup cpuset found
    quota_cores: float | None  # None: no CPU quota
    cgroup: str  # "v1", "v2" or "none"
    reason: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _proc_cgroups(root: Path) -> dict[str, str]:
    """controller -> cgroup path from /proc/self/cgroup ("" is the v2 unified entry)."""
    out: dict[str, str] = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def _mounts(root: Path) -> dict[str, Path]:
    """v1 controller (and "" for cgroup2) -> mount point, from /proc/self/mountinfo."""
    out: dict[str, Path] = {}
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount_point = root / fields[4].lstrip("/")
        if tail[0] == "cgroup2":
            out.setdefault("", mount_point)
        elif tail[0] == "cgroup":
            for opt in tail[2].split(","):
                out.setdefault(opt, mount_point)
    return out


def _levels(mount: Path, cgroup_path: str) -> list[Path]:
    """The cgroup's directory and every ancestor up to the mount point, innermost first.

    Inside a cgroup namespace the path is "/" and the mount is the container's own cgroup."""
    parts = [p for p in cgroup_path.split("/") if p]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_quota(level: Path) -> float | None:
    text = _read(level / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max":
        return None
    return int(quota) / int(period or 100000)


def _v1_quota(level: Path) -> float | None:
    quota, period = _read(level / "cpu.cfs_quota_us"), _read(level / "cpu.cfs_period_us")
    if quota is None or period is None or int(quota) <= 0:
        return None
    return int(quota) / int(period)


def _limits(root: Path) -> tuple[str, tuple[int, ...] | None, float | None]:
    """(cgroup version, cpuset, quota in cores) of this process."""
    groups, mounts = _proc_cgroups(root), _mounts(root)
    if "cpu" in groups or "cpuset" in groups:  # v1 (possibly hybrid)
        cpuset = None
        if "cpuset" in groups and "cpuset" in mounts:
            for level in _levels(mounts["cpuset"], groups["cpuset"]):
                text = _read(level / "cpuset.effective_cpus") or _read(level / "cpuset.cpus")
                if text:
                    cpuset = parse_cpu_list(text)
                    break
        quotas = []
        if "cpu" in groups and "cpu" in mounts:
            quotas = [q for q in map(_v1_quota, _levels(mounts["cpu"], groups["cpu"])) if q is not None]
        return "v1", cpuset, min(quotas) if quotas else None
    if "" in groups and "" in mounts:
        levels = _levels(mounts[""], groups[""])
        cpuset = None
        for level in levels:
            text = _read(level / "cpuset.cpus.effective")
            if text:
                cpuset = parse_cpu_list(text)
                break
        quotas = [q for q in map(_v2_quota, levels) if q is not None]
        return "v2", cpuset, min(quotas) if quotas else None
    return "none", None, None


def usable_cores(
    override: str | None = None,
    *,
    root: Path = Path("/"),
    affinity: tuple[int, ...] | None = None,
) -> UsableCores:
    """The cores Packrat may plan on; `override` (or $PACKRAT_CORES) wins when given."""
    aff = tuple(sorted(affinity if affinity is not None else os.sched_getaffinity(0)))
    asked = settings.lookup("cores", cli=override)  # override > $PACKRAT_CORES > none
    given = asked.value
    version, cpuset, quota = _limits(root)
    if given:
        try:
            cores = parse_cpu_list(given)
        except ValueError as exc:
            raise ConfigError(f"cores {given!r}: not a CPU list such as 0-3,8") from exc
        if not cores:
            raise ConfigError(f"cores {given!r}: no core given")
        source = "override" if asked.source == "cli" else f"${ENV_VAR}"
        return UsableCores(cores, aff, cpuset, quota, version, f"{source} {given!r}")
    cores = tuple(c for c in aff if cpuset is None or c in cpuset)
    reason = [f"affinity {len(aff)} cores"]
    if cpuset is not None:
        reason.append(f"∩ cgroup {version} cpuset {len(cpuset)} -> {len(cores)}")
    if quota is not None and math.floor(quota) < len(cores):
        keep = max(1, math.floor(quota))
        cores = cores[:keep]
        reason.append(f"capped by cgroup {version} CPU quota {quota:g} cores -> {keep}")
    elif quota is not None:
        reason.append(f"cgroup {version} CPU quota {quota:g} cores (not binding)")
    if not cores:
        raise ConfigError(f"no usable cores: affinity {aff}, cgroup cpuset {cpuset}")
    return UsableCores(cores, aff, cpuset, quota, version, ", ".join(reason))


def read_cpu_ticks(path: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """{cpu: (idle ticks, all ticks)} since boot, per CPU ("cpuN" lines of /proc/stat; idle +
    iowait as idle), in USER_HZ ticks: how busy cores were between two readings, whoever
    ran on them (the controller's quiet clock, the profiler's share of others on its cores)."""
    out: dict[int, tuple[int, int]] = {}
    with open(path) as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            out[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return out
