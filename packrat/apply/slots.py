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

Every worker whose handler calls claim_and_pin() (with or without a plan)
also keeps a small status file, `<slot dir>/workers/<pid>.json`: its slot,
cores and threads, the torch intra-op thread count and CPU affinity it
actually runs with, and how many batches it has started and finished. The
controller reads it for two things TorchServe's API does not tell: that a
worker is pinned as planned, and whether it still has a batch in flight
(TorchServe 0.12 reports only READY/UNLOADING per worker).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
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


def slot_root() -> Path:
    return Path(os.environ.get("PACKRAT_SLOT_DIR", Path(tempfile.gettempdir()) / "packrat-slots"))


def slot_lock_dir(plan_id: str) -> Path:
    return slot_root() / plan_id


def worker_status_path(pid: int) -> Path:
    return slot_root() / "workers" / f"{pid}.json"


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


class _WorkerStatus:
    """Writes this worker's status file; one instance per worker process."""

    def __init__(self, claim: SlotClaim | None) -> None:
        self.claim = claim
        self.path = worker_status_path(os.getpid())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.started = 0
        self.done = 0

    def write(self, busy: bool) -> None:
        import torch

        claim = self.claim
        record = {
            "pid": os.getpid(),
            "plan_id": None if claim is None else Path(claim.lock_path).parent.name,
            "slot": None if claim is None else claim.index,
            "cores": None if claim is None else list(claim.cores),
            "threads": None if claim is None else claim.threads,
            # What the worker really runs with, read at this moment, not what was asked for.
            "torch_threads": torch.get_num_threads(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "started": self.started,
            "done": self.done,
            "busy": busy,
            "time": time.time(),
        }
        # Write-then-rename so a reader never sees half a record.
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)

    def batch_started(self) -> None:
        self.started += 1
        self.write(busy=True)

    def batch_done(self) -> None:
        self.done += 1
        self.write(busy=False)


_status: _WorkerStatus | None = None


def read_worker_status(pid: int) -> dict[str, Any] | None:
    """The status record of worker `pid`, or None if it has none (yet)."""
    try:
        record = json.loads(worker_status_path(pid).read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("pid") == pid else None


def _track_batches() -> None:
    """Count batches in flight around TorchServe's Service.predict in this worker.

    Why here and not in the handler: it then works for any handler that calls
    claim_and_pin(). Service.predict is looked up per call, so wrapping the
    class attribute after the service exists still takes effect. Pinned to
    TorchServe 0.12.0 (ts.service.Service.predict(self, batch)).
    """
    try:
        from ts.service import Service
    except ImportError:  # not inside a TorchServe worker (e.g. a unit test)
        return
    original = Service.predict
    if getattr(original, "_packrat_tracked", False):
        return

    def predict(self: Any, batch: Any) -> Any:
        status = _status
        if status is not None:
            status.batch_started()
        try:
            return original(self, batch)
        finally:
            if status is not None:
                status.batch_done()

    predict._packrat_tracked = True  # type: ignore[attr-defined]
    Service.predict = predict  # type: ignore[method-assign]


def claim_and_pin(model_yaml_config: dict[str, Any] | None) -> SlotClaim | None:
    """Entry point for the handler. Returns None for a version without a Packrat plan."""
    global _status
    packrat_cfg = (model_yaml_config or {}).get("packrat") or {}
    claim = None
    if "slots" in packrat_cfg:
        claim = claim_slot(packrat_cfg)
        pin_process(claim.cores, claim.threads)
    # Tracked even without a plan: the first swap away from a plain version drains it too.
    _status = _WorkerStatus(claim)
    _status.write(busy=False)
    _track_batches()
    return claim
