"""The hardware/software fingerprint a profile's numbers depend on.

Two profiles are comparable only if every field is equal:

  cpu_model      "model name" from /proc/cpuinfo (platform.processor() fallback)
  usable_cores   cores this process may run on (sched_getaffinity), not the
                 machine's total: a cgroup/taskset limit changes what t can be
  allocator      from the environment the workers inherit:
                   "jemalloc" / "tcmalloc"  when LD_PRELOAD names that library,
                   "glibc-tuned"            when GLIBC_TUNABLES sets glibc.malloc.*,
                   "glibc"                  otherwise
                 (measured with ResNet-50 on a 2-core AMX Xeon: tuned glibc
                 1.1-1.3x faster than plain glibc, Debian's jemalloc 5.3 up to 2x slower)
  torch_version  installed torch distribution version (read without importing torch)
  mode           "<precision>-<runtime>" from the archive's model_config.yaml:
                 packrat.precision (default fp32) and packrat.runtime (default
                 eager; "torchscript" = frozen graph mode), read as the worker
                 reads them (packrat.modes.ExecutionMode)
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict
from importlib import metadata
from typing import Any, Mapping

from packrat.modes import ExecutionMode
from packrat.types import Fingerprint


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """Cores this process may run on, containers included (packrat.cores)."""
    from packrat.cores import usable_cores as found

    return len(found().cores)


def allocator(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    preload = env.get("LD_PRELOAD", "").lower()
    if "jemalloc" in preload:
        return "jemalloc"
    if "tcmalloc" in preload:
        return "tcmalloc"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "glibc-tuned"
    return "glibc"


def torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def mode_from_config(config: Mapping[str, Any]) -> str:
    """"<precision>-<runtime>", e.g. "fp32-eager" or "bf16-torchscript"; defaults fp32/eager."""
    return str(ExecutionMode.from_config(config))


def split_mode(mode: str) -> tuple[str, str]:
    """"bf16-openvino" -> ("bf16", "openvino"); ValueError when it is not "<precision>-<runtime>"."""
    parsed = ExecutionMode.parse(mode)
    return parsed.precision, parsed.runtime


def config_in_mode(config: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """A copy of an archive's config that runs in `mode` (packrat.precision/runtime set),
    everything else unchanged: one base archive serves every mode."""
    return ExecutionMode.parse(mode).in_config(config)


def current_fingerprint(config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Fingerprint:
    """The fingerprint a profile of an archive with `config` would get on this machine now."""
    return Fingerprint(
        cpu_model=cpu_model(),
        usable_cores=usable_cores(),
        allocator=allocator(env),
        torch_version=torch_version(),
        mode=mode_from_config(config),
    )


def differences(a: Fingerprint, b: Fingerprint) -> list[str]:
    """Human-readable list of the fields where `a` (the file) and `b` (expected) differ."""
    da, db = asdict(a), asdict(b)
    return [f"{k}: {da[k]!r} != {db[k]!r}" for k in da if da[k] != db[k]]
