"""Apply a plan to a running TorchServe by an active-passive version swap.

    create version dir -> register + start N workers (asynchronous call, then poll)
      -> wait: every worker READY, claimed its slot, pinned to the slot's cores
         with the slot's torch thread count (checked in /proc and the worker's status file)
      -> set-default (takes effect for the next request)
      -> drain the old version: its queue is empty and no worker has a batch in flight
      -> unregister the old version, delete its version dir

Why the drain matters: TorchServe 0.12 answers the in-flight batch of a worker
it scales down or unregisters with HTTP 500 ("Worker died."), and its describe
call reports only READY/UNLOADING per worker and `pendingRequests` (queued jobs
only, not the batch a worker holds). The in-flight signal therefore comes from
the workers themselves: packrat.slots counts batches started/finished
per worker pid. For a worker without that file (a handler that does not call
claim_and_pin) the fallback is its CPU time standing still for a quiet window.

Core policy while two versions overlap: the new version gets the deterministic
layout of assign_cores() over the same usable cores (from core 0), so it
shares cores with the old one from the moment its workers start loading until
the old one is unregistered. No cores are held back for the swap: on a small
machine that would mean serving with fewer cores all the time to make swaps
cheaper. The cost (the overlap lasts register + warm-up + drain) is measured
by scripts/measure_swap.py and reported in docs/live-plans.md.

Failure before set-default: the new version is unregistered (it had no
traffic) and its directory removed; the old one never stopped serving.
Failure after set-default: the old version is made default again, the new one
drained and unregistered. Either way SwapError says what failed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from packrat import slots
from packrat.apply import versions
from packrat.apply.client import ManagementClient
from packrat.apply.versions import VersionDir
from packrat.errors import ConfigError, SwapError, TorchServeError
from packrat.types import Plan, SwapRecord


@dataclass(frozen=True)
class SwapSettings:
    register_timeout_s: float = 60.0  # the register call itself (workers start after it returns)
    ready_timeout_s: float = 300.0  # all workers READY and pinned: cold workers load on busy cores
    # A worker that TorchServe had to start this many times is failing, not slow.
    max_worker_starts: int = 3
    drain_timeout_s: float = 120.0
    # An in-flight counter must read the same for this long before we trust it.
    drain_quiet_s: float = 0.5
    # Keep the old version for at least this long after set-default. A request
    # that TorchServe routed to the old default just before set-default can be
    # enqueued later if its Netty thread is preempted between picking the
    # version and adding the job (ModelManager.addJob); once the version is
    # unregistered, such a job waits forever. On a loaded 2-core box threads
    # wait hundreds of ms for a CPU, so this grace is seconds, not microseconds.
    min_drain_s: float = 2.0
    poll_s: float = 0.05
    max_batch_delay_ms: int | None = None  # None: versions.batch_delay_ms(plan)


# -- reading worker state -------------------------------------------------------


def proc_affinity(pid: int) -> tuple[int, ...] | None:
    """CPU affinity of a process's main thread as the kernel reports it."""
    try:
        return slots.parse_cpu_list(slots.cpus_allowed_list(f"/proc/{pid}/status"))
    except OSError:
        return None


def proc_thread_affinities(pid: int) -> set[tuple[int, ...]]:
    """Affinities of every thread of `pid` (all must be pinned, not just the main one)."""
    out = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out.add(slots.parse_cpu_list(slots.cpus_allowed_list(f"/proc/{pid}/task/{tid}/status")))
        except OSError:
            continue  # thread exited meanwhile
    return out


def proc_cpu_ticks(pid: int) -> int | None:
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(rest[11]) + int(rest[12])  # utime + stime


def worker_pids(described: dict[str, Any]) -> list[int]:
    return [int(w["pid"]) for w in described.get("workers", []) if int(w.get("pid", -1)) > 0]


@dataclass(frozen=True)
class WorkerCheck:
    pid: int
    ready: bool
    slot: int | None
    cores: tuple[int, ...] | None
    affinity: tuple[int, ...] | None
    torch_threads: int | None
    ok: bool
    why: str = ""


def check_workers(described: dict[str, Any], vdir: VersionDir) -> list[WorkerCheck]:
    """Is every worker of a version READY, in its own slot, pinned and sized as planned?"""
    checks = []
    seen_slots: set[int] = set()
    slot_by_index = {i: s for i, s in enumerate(vdir.slots)}
    for w in described.get("workers", []):
        pid = int(w.get("pid", -1))
        ready = w.get("status") == "READY"
        status = slots.read_worker_status(pid) if pid > 0 else None
        if not ready or status is None:
            checks.append(WorkerCheck(pid, ready, None, None, None, None, False, "not ready or no status yet"))
            continue
        index = status.get("slot")
        expected = slot_by_index.get(index) if isinstance(index, int) else None
        affinity = proc_affinity(pid)
        threads_aff = proc_thread_affinities(pid)
        why = ""
        if status.get("plan_id") != vdir.plan_id or expected is None:
            why = f"status names plan {status.get('plan_id')} slot {index}, expected plan {vdir.plan_id}"
        elif index in seen_slots:
            why = f"slot {index} claimed twice"
        elif affinity != expected.cores or threads_aff != {expected.cores}:
            why = f"affinity {affinity} (threads {sorted(threads_aff)}) != slot cores {expected.cores}"
        elif status.get("torch_threads") != expected.threads:
            why = f"torch threads {status.get('torch_threads')} != slot threads {expected.threads}"
        if isinstance(index, int):
            seen_slots.add(index)
        checks.append(
            WorkerCheck(
                pid,
                ready,
                index if isinstance(index, int) else None,
                expected.cores if expected else None,
                affinity,
                status.get("torch_threads"),
                not why,
                why,
            )
        )
    return checks


def _forget_worker_status(pids: list[int]) -> None:
    """Delete the status files of workers that are gone (they would pile up otherwise)."""
    for pid in pids:
        slots.worker_status_path(pid).unlink(missing_ok=True)


# -- the swap ------------------------------------------------------------------


class Swapper:
    """Applies plans to one model of one TorchServe. Not thread-safe: one swap at a time."""

    def __init__(
        self,
        client: ManagementClient,
        model_store: str | Path,
        cores: Sequence[int] | None = None,
        settings: SwapSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.model_store = Path(model_store)
        # Usable cores: this process's affinity (what the machine/container gives us).
        self.cores = list(cores) if cores is not None else sorted(os.sched_getaffinity(0))
        self.settings = settings or SwapSettings()
        self.clock = clock

    # The default version and what directory it was registered from.
    def current(self, model: str) -> tuple[str, str]:
        d = self.client.describe(model)
        return d["modelVersion"], d["modelUrl"]

    def base_of(self, url: str) -> str:
        """The base model directory behind a registered url (itself, or a Packrat version's base)."""
        path = self.model_store / url
        vdir = versions.load_version(path) if (path / versions.MANIFEST).exists() else None
        return vdir.base if vdir else url

    def apply(self, model: str, plan: Plan) -> SwapRecord:
        """Make `plan` the live shape of `model`. Returns the record; raises SwapError on failure."""
        s = self.settings
        versions.validate_plan(plan, len(self.cores))  # ConfigError: nothing touched yet
        old_version, old_url = self.current(model)
        record = SwapRecord(model=model, from_version=old_version, to_version=None, plan=plan,
                            started_at=time.time())
        phases: list[tuple[str, float]] = []
        warnings: list[str] = []
        t0 = self.clock()
        mark = t0

        def phase(name: str) -> None:
            nonlocal mark
            now = self.clock()
            phases.append((name, round(now - mark, 3)))
            mark = now

        def finish(outcome: str, error: str | None = None) -> SwapRecord:
            return replace(record, outcome=outcome, error=error, phases_s=tuple(phases),
                           warnings=tuple(warnings), duration_s=round(self.clock() - t0, 3))

        vdir = versions.create_version(
            self.model_store,
            self.base_of(old_url),
            model,
            plan,
            self.cores,
            max_batch_delay_ms=s.max_batch_delay_ms,
        )
        record = replace(record, to_version=vdir.version)
        phase("create")
        defaulted = False
        try:
            self.client.register(vdir.url, model, len(vdir.slots), timeout_s=s.register_timeout_s)
            phase("register")
            self._wait_ready(model, vdir)
            phase("ready")
            self.client.set_default(model, vdir.version)
            defaulted = True
            phase("set_default")
            self.drain(model, old_version)
            phase("drain")
        except (TorchServeError, SwapError, ConfigError) as exc:
            outcome = self._rollback(model, old_version, vdir, defaulted, warnings)
            failed = finish(outcome, f"{type(exc).__name__}: {exc}")
            raise SwapError(
                f"swap of {model} {old_version} -> {vdir.version} failed "
                f"({outcome.replace('_', ' ')}): {exc}",
                record=failed,
            ) from exc
        # Past the point of no return: the new version serves. Clean-up failures are warnings.
        try:
            old_pids = worker_pids(self.client.describe(model, old_version))
            self.client.unregister(model, old_version)
            _forget_worker_status(old_pids)
        except TorchServeError as exc:
            warnings.append(f"old version {old_version} not unregistered: {exc}")
        phase("unregister")
        self.retire_dir(old_url)
        return finish("applied")

    # -- phases ------------------------------------------------------------------

    def _wait_ready(self, model: str, vdir: VersionDir) -> None:
        deadline = self.clock() + self.settings.ready_timeout_s
        last: list[WorkerCheck] = []
        pids_by_worker: dict[str, set[int]] = {}
        while self.clock() < deadline:
            d = self.client.describe(model, vdir.version)
            last = check_workers(d, vdir)
            if len(last) == len(vdir.slots) and all(c.ok for c in last):
                return
            # A wrong pin will not fix itself; a missing status might (worker still loading).
            wrong = [c for c in last if c.ready and c.why and "no status" not in c.why]
            if wrong:
                raise SwapError(f"workers of {model} {vdir.version} not as planned: {[c.why for c in wrong]}")
            # TorchServe restarts a worker that dies while loading, forever (with back-off).
            for w in d.get("workers", []):
                if int(w.get("pid", -1)) > 0:
                    pids_by_worker.setdefault(str(w.get("id")), set()).add(int(w["pid"]))
            dying = {k: sorted(v) for k, v in pids_by_worker.items() if len(v) >= self.settings.max_worker_starts}
            if dying:
                raise SwapError(
                    f"workers of {model} {vdir.version} keep dying while loading (worker id: pids {dying}); "
                    "see TorchServe's model_log.log"
                )
            time.sleep(self.settings.poll_s * 4)
        raise SwapError(
            f"workers of {model} {vdir.version} not READY and pinned after "
            f"{self.settings.ready_timeout_s:.0f}s: {[(c.pid, c.why) for c in last]}"
        )

    def drain(self, model: str, version: str) -> None:
        """Return once `version` has an empty queue and no batch in flight, stably."""
        s = self.settings
        began = self.clock()
        deadline = began + s.drain_timeout_s
        # A worker may hold jobs it took from the queue for up to maxBatchDelay while
        # it fills its batch; after that they are in flight and the counters see them.
        quiet_needed = s.drain_quiet_s
        quiet_since: float | None = None
        last_snapshot: Any = None
        while self.clock() < deadline:
            d = self.client.describe(model, version)
            quiet_needed = max(s.drain_quiet_s, 2 * int(d.get("maxBatchDelay", 0)) / 1000.0)
            pending = int((d.get("jobQueueStatus") or {}).get("pendingRequests", 0))
            snapshot = self._in_flight_snapshot(d)
            idle = pending == 0 and snapshot is not None and all(x[1] for x in snapshot)
            now = self.clock()
            if idle and snapshot == last_snapshot:
                if quiet_since is not None and now - quiet_since >= quiet_needed and now - began >= s.min_drain_s:
                    return
            else:
                quiet_since = now if idle else None
            last_snapshot = snapshot if idle else None
            time.sleep(s.poll_s)
        raise SwapError(f"{model} {version} did not drain within {s.drain_timeout_s:.0f}s")

    @staticmethod
    def _in_flight_snapshot(described: dict[str, Any]) -> tuple[tuple[Any, bool], ...] | None:
        """Per worker: (a counter that moves with every batch, idle?)."""
        out = []
        for pid in worker_pids(described):
            status = slots.read_worker_status(pid)
            if status is not None:
                started, done = int(status["started"]), int(status["done"])
                out.append(((pid, started, done), started == done and not status.get("busy")))
            else:
                ticks = proc_cpu_ticks(pid)
                if ticks is None:
                    continue  # process gone
                # Fallback: idle means the CPU time stands still across the quiet window.
                out.append(((pid, ticks), True))
        return tuple(out)

    def _rollback(
        self, model: str, old_version: str, vdir: VersionDir, defaulted: bool, warnings: list[str]
    ) -> str:
        try:
            if defaulted:
                self.client.set_default(model, old_version)
                self.drain(model, vdir.version)
            if any(d.get("modelVersion") == vdir.version for d in self._describe_all(model)):
                new_pids = worker_pids(self.client.describe(model, vdir.version))
                self.client.unregister(model, vdir.version)
                _forget_worker_status(new_pids)
        except (TorchServeError, SwapError) as exc:
            warnings.append(f"rollback incomplete: {exc}")
            return "failed"
        versions.remove_version(vdir.path)
        self._forget_slots(vdir.plan_id)
        return "rolled_back"

    def _describe_all(self, model: str) -> list[dict[str, Any]]:
        try:
            return self.client.describe_all(model)
        except TorchServeError:
            return []

    def retire_dir(self, url: str) -> None:
        """Delete a retired Packrat version dir (never a base model dir) and its slot locks."""
        path = self.model_store / url
        if not (path / versions.MANIFEST).exists():
            return
        vdir = versions.load_version(path)
        if vdir is None:
            return  # a plain model directory: the user's, keep it
        versions.remove_version(path)
        self._forget_slots(vdir.plan_id)

    @staticmethod
    def _forget_slots(plan_id: str) -> None:
        lock_dir = slots.slot_lock_dir(plan_id)
        if lock_dir.is_dir():
            for p in lock_dir.iterdir():
                p.unlink(missing_ok=True)
            try:
                lock_dir.rmdir()
            except OSError:
                pass


def apply(
    plan: Plan,
    *,
    model: str,
    client: ManagementClient,
    model_store: str | Path,
    cores: Sequence[int] | None = None,
    settings: SwapSettings | None = None,
) -> SwapRecord:
    """Functional entry point: `apply(plan, model=..., client=..., model_store=...)`."""
    return Swapper(client, model_store, cores, settings).apply(model, plan)
