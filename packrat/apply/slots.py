"""Thin-worker slots: which cores and how many threads this worker process gets.

TorchServe tells a worker no index, so each worker claims a free slot of its
version's plan by taking an exclusive flock on the slot's lock file. The OS
releases the lock when the process dies, so a worker that TorchServe restarts
takes over the freed slot with the same cores.

The plan travels in the version's model_config.yaml:

    packrat:
      plan_id: 3f2a...            # unique per version directory
      slots:                      # one entry per worker
        - {cores: [0], threads: 1}
        - {cores: [1], threads: 1}

This module runs inside TorchServe's worker, in the handler's initialize(),
before the model is loaded (so torch's thread pools start on the right cores).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packrat.errors import ConfigError

# Kept open for the life of the worker process: closing it would free the slot.
_held_lock_fd: int | None = None


@dataclass(frozen=True)
class SlotClaim:
    index: int
    cores: tuple[int, ...]
    threads: int
    lock_path: str


def slot_lock_dir(plan_id: str) -> Path:
    root = Path(os.environ.get("PACKRAT_SLOT_DIR", Path(tempfile.gettempdir()) / "packrat-slots"))
    return root / plan_id


def parse_slots(packrat_cfg: dict[str, Any]) -> list[tuple[tuple[int, ...], int]]:
    slots = packrat_cfg.get("slots")
    if not isinstance(slots, list) or not slots:
        raise ConfigError("packrat.slots must be a non-empty list of {cores: [...], threads: n}")
    out = []
    for i, s in enumerate(slots):
        try:
            cores = tuple(int(c) for c in s["cores"])
            threads = int(s.get("threads", len(cores)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"packrat.slots[{i}] is malformed: {s!r}") from exc
        if not cores or threads < 1:
            raise ConfigError(f"packrat.slots[{i}] needs at least one core and one thread: {s!r}")
        out.append((cores, threads))
    return out


def claim_slot(packrat_cfg: dict[str, Any]) -> SlotClaim:
    """Take the first free slot's lock (non-blocking); raise if every slot is taken."""
    global _held_lock_fd
    plan_id = str(packrat_cfg.get("plan_id") or "")
    if not plan_id:
        raise ConfigError("packrat.plan_id is missing from model_config.yaml")
    slots = parse_slots(packrat_cfg)
    lock_dir = slot_lock_dir(plan_id)
    lock_dir.mkdir(parents=True, exist_ok=True)
    for index, (cores, threads) in enumerate(slots):
        path = lock_dir / f"slot-{index}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        if _held_lock_fd is not None:
            os.close(_held_lock_fd)
        _held_lock_fd = fd
        return SlotClaim(index=index, cores=cores, threads=threads, lock_path=str(path))
    raise ConfigError(
        f"all {len(slots)} slots of plan {plan_id} are taken; more workers than the plan has instances"
    )


def pin_process(cores: tuple[int, ...], threads: int) -> None:
    """Pin every thread of this process to `cores` and size torch's pools.

    sched_setaffinity(0) only moves the calling thread, so threads that already
    exist (TorchServe's, or a pool torch started early) are moved one by one.
    """
    import torch  # imported here: nothing at import time touches torch settings

    core_set = set(cores)
    os.sched_setaffinity(0, core_set)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), core_set)
        except (ProcessLookupError, PermissionError):
            pass  # thread exited meanwhile
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set or inter-op pool already started; intra-op count is what matters


def claim_and_pin(model_yaml_config: dict[str, Any] | None) -> SlotClaim | None:
    """Entry point for the handler. Returns None for a version without a Packrat plan."""
    packrat_cfg = (model_yaml_config or {}).get("packrat") or {}
    if "slots" not in packrat_cfg:
        return None
    claim = claim_slot(packrat_cfg)
    pin_process(claim.cores, claim.threads)
    return claim
