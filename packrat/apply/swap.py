"""Apply a plan to a running TorchServe by an active-passive version swap.

    create version dir -> register + start N workers (asynchronous call, then poll)
      -> wait: every worker READY, claimed its slot, pinned to the slot's cores
         with the slot's torch thread count (checked in /proc and the worker's status file)
      -> set-default (takes effect for the next request)
      -> drain the old version: its queue is empty and no worker has a batch in flight
      -> retire the old version (Swapper.retire): scale it to 0 workers synchronously,
         confirm its queue is empty, unregister it; delete its version dir

Why the drain matters: TorchServe 0.12 answers the in-flight batch of a worker
it scales down or unregisters with HTTP 500 ("Worker died."), and its describe
call reports only READY/UNLOADING per worker and `pendingRequests` (queued jobs
only, not the batch a worker holds). The in-flight signal therefore comes from
the workers themselves: packrat.slots counts batches started/finished per
worker pid (finished = the answer was sent), and the kernel tells the bytes
sent to each worker that it has not read (unread_bytes). For a worker without
that file (a handler that does not call claim_and_pin) the fallback is its CPU
time standing still for a quiet window.

Why unregistering after the drain is not enough (TorchServe 0.12 frontend,
WorkerThread/BatchAggregator): jobs a worker's frontend thread has already
taken from the queue are in neither `pendingRequests` nor the batch counters
(unread_bytes sees them only while they sit unread in the worker's socket,
not while the frontend collects a batch, nor once the worker has read them
and not yet entered predict). When a worker is shut down its aggregator
usually puts such jobs back at the head of its version's queue (a race in
WorkerThread.shutdown answers them 500 instead). Unregistering removes the
version first, so they went back into a queue nobody serves and were never
answered. Scaling the still-registered version to 0 workers puts them back
where describe counts them: retire() then scales the version up again to
serve them, drains, and tries again.

Core policy while two versions overlap: the new version gets the deterministic
layout of assign_cores() over the same usable cores (from core 0), so it
shares cores with the old one from the moment its workers start loading until
the old one is unregistered. No cores are held back for the swap: on a small
machine that would mean serving with fewer cores all the time to make swaps
cheaper. The cost (the overlap lasts register + warm-up + drain) is measured
by scripts/measure_swap.py and reported in docs/live-plans.md.

Phase timings: every phase above is timed into SwapRecord.phases_s (retire and
unregister apart), and the ready phase is split (SwapRecord.ready_phases_s,
startup_breakdown) into worker_start, model_load, mode_build, guard, warmup and
ready_check from the start-up timeline each new worker writes into its status
file (packrat.slots.report_startup), read while the swap waits for READY.

Failure before set-default: the new version is retired (it had no traffic)
and its directory removed; the old one never stopped serving.
Failure after set-default: the old version is made default again and the new
one retired. Either way SwapError says what failed. A version directory is
deleted only once TorchServe no longer lists the version: a version that
could not be unregistered keeps its directory (TorchServe restarts its workers
from it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from packrat import slots
from packrat.apply import versions
from packrat.apply.client import ManagementClient, ModelDescription
from packrat.apply.versions import VersionDir
from packrat.errors import ConfigError, ModeRefusedError, SwapError, TorchServeError, is_mode_refusal
from packrat.types import Plan, SwapRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwapSettings:
    register_timeout_s: float = 60.0  # the register call itself (workers start after it returns)
    ready_timeout_s: float = 300.0  # all workers READY and pinned: cold workers load on busy cores
    # A worker that TorchServe had to start this many times is failing, not slow.
    max_worker_starts: int = 3
    drain_timeout_s: float = 120.0
    # An in-flight counter must read the same for this long before we trust it.
    drain_quiet_s: float = 0.5
    # Keep the old version's workers for at least this long after set-default.
    # A request that TorchServe routed to the old default just before
    # set-default can be enqueued later if its Netty thread is preempted between
    # picking the version and adding the job (ModelManager.addJob). While the
    # old version has workers such a job is served; once it is scaled to 0 the
    # job is refused with 503 (addJob finds no worker), and after unregister it
    # would be lost. retire() catches the jobs that do reach the queue, not the
    # 503, so the grace stays. On a loaded 2-core box threads wait hundreds of
    # ms for a CPU, so it is seconds, not microseconds.
    min_drain_s: float = 2.0
    # Rounds of scale to 0 -> queue not empty -> scale up, drain before retire() gives up.
    retire_attempts: int = 3
    scale_timeout_s: float = 120.0  # a synchronous scale to 0 (kills each worker, waits for it)
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


def stat_cpu_ticks(stat_path: str) -> tuple[str, int] | None:
    """(name, utime + stime ticks) from a /proc stat file, of a process or of one of its
    threads (/proc/<pid>/task/<tid>/stat); None: gone."""
    try:
        stat = Path(stat_path).read_text()
    except OSError:
        return None
    rest = stat.rsplit(")", 1)[1].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], int(rest[11]) + int(rest[12])


def proc_cpu_ticks(pid: int) -> int | None:
    """utime + stime of process `pid`, all its threads; None: gone."""
    read = stat_cpu_ticks(f"/proc/{pid}/stat")
    return read[1] if read else None


def _socket_inodes(pid: int) -> set[int] | None:
    """Inodes of the sockets process `pid` holds open (from /proc/<pid>/fd)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    out = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


# Linux sock_diag for AF_UNIX (linux/sock_diag.h, linux/unix_diag.h).
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_DONE, _NLMSG_ERROR = 3, 2
_UDIAG_SHOW_RQLEN = 0x10
_UNIX_DIAG_RQLEN = 4
_TCP_LISTEN = 10


def unix_receive_queues() -> dict[int, int] | None:
    """Bytes waiting to be read in every connected AF_UNIX socket of this network
    namespace, by socket inode (what `ss -x` shows as Recv-Q); None if the kernel
    will not say."""
    import socket
    import struct

    req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, _UDIAG_SHOW_RQLEN, 0xFFFFFFFF, 0xFFFFFFFF)
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + req
    out: dict[int, int] = {}
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(2.0)
            nl.send(msg)
            while True:
                data = nl.recv(1 << 16)
                off = 0
                while off + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, off)
                    if kind == _NLMSG_DONE:
                        return out
                    if kind == _NLMSG_ERROR or length < 16:
                        return None
                    # unix_diag_msg: family, type, state, pad, ino, cookie[2]; then attributes
                    _, _, state, _, ino = struct.unpack_from("=BBBBI", data, off + 16)
                    a = off + 16 + 16
                    while a + 4 <= off + length:
                        alen, atype = struct.unpack_from("=HH", data, a)
                        if alen < 4:
                            break
                        if atype == _UNIX_DIAG_RQLEN and state != _TCP_LISTEN:
                            out[ino] = struct.unpack_from("=I", data, a + 4)[0]
                        a += (alen + 3) & ~3
                    off += (length + 3) & ~3
                if not data:
                    return out
    except OSError:
        return None


def unread_bytes(pid: int, queues: dict[int, int] | None = None) -> int | None:
    """Bytes sent to process `pid` over its sockets that it has not read yet.

    A TorchServe Python worker reads each batch from its socket to the frontend;
    while it has not (a worker starved of CPU, or stopped), the batch is in
    neither the queue TorchServe reports nor the worker's own counters, but it
    is here. None when it cannot be read (the process is gone, or no sock_diag).
    """
    inodes = _socket_inodes(pid)
    queues = unix_receive_queues() if queues is None else queues
    if inodes is None or queues is None:
        return None
    return sum(queues.get(i, 0) for i in inodes)


def pending_requests(described: ModelDescription | dict[str, Any]) -> int:
    """Jobs in a version's queue (TorchServe counts only its default data queue)."""
    return ModelDescription.of(described).pending_requests


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


def check_workers(described: ModelDescription | dict[str, Any], vdir: VersionDir) -> list[WorkerCheck]:
    """Is every worker of a version READY, in its own slot, pinned and sized as planned?"""
    checks = []
    seen_slots: set[int] = set()
    slot_by_index = {i: s for i, s in enumerate(vdir.slots)}
    for w in ModelDescription.of(described).workers:
        pid, ready = w.pid, w.ready
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
        # Every thread inside the slot; a runtime may pin its own threads to single cores
        # of it (OpenVINO's ENABLE_CPU_PINNING does, on a 2-thread slot: seen as (1,)).
        elif affinity != expected.cores or not all(t and set(t) <= set(expected.cores) for t in threads_aff):
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


STARTUP_PHASES = ("model_load", "mode_build", "guard", "warmup")


def load_errors(pids: Iterable[int]) -> list[str]:
    """What the handler reported from its failed load (`load_error` in the status file of
    each of these workers that has one), in pid order."""
    found = []
    for pid in sorted(set(pids)):
        error = (slots.read_worker_status(pid) or {}).get("startup", {}).get("load_error")
        if error:
            found.append(str(error))
    return found


def startup_breakdown(
    statuses: Sequence[dict[str, Any] | None], register_end: float, ready_end: float
) -> tuple[tuple[tuple[str, float], ...], tuple[dict[str, Any], ...]]:
    """Where a swap's "ready" phase went, from the new workers' status files.

    The workers start in parallel, so the phase lasts as long as the one that
    finished loading last: its path is worker_start (from the end of the
    register call to the handler's model load beginning: TorchServe spawning
    the process, Python, TorchServe's worker and torch imports, slot claim and
    pinning), then its own model_load, mode_build, guard and warmup, then
    ready_check (from its load finishing to the swap seeing every worker READY
    and pinned: TorchServe marking it READY, the swap's polling, slower
    siblings). Wall-clock times (the worker is another process). Second value:
    one entry per worker. Empty when no worker reported its start-up (a
    handler that does not call packrat.slots.report_startup).
    """
    workers = []
    for st in statuses:
        up = (st or {}).get("startup") or {}
        if not isinstance(up.get("loaded_at"), (int, float)):
            continue
        born, pinned = up.get("process_started_at"), up.get("pinned_at") or up["loaded_at"]
        workers.append({
            "pid": st.get("pid"), "slot": st.get("slot"), "loaded_at": up["loaded_at"], "pinned_at": pinned,
            "process_start_s": round(pinned - born, 3) if isinstance(born, (int, float)) else None,
            "phases_s": {k: float(v) for k, v in (up.get("phases") or {}).items()},
            "cache": dict(up.get("cache") or {}),
        })
    if not workers:
        return (), ()
    last = max(workers, key=lambda w: w["loaded_at"])
    out = [("worker_start", max(0.0, last["pinned_at"] - register_end))]
    out += [(k, last["phases_s"].get(k, 0.0)) for k in STARTUP_PHASES]
    out.append(("ready_check", max(0.0, ready_end - last["loaded_at"])))
    per_worker = tuple({k: v for k, v in w.items() if k not in ("loaded_at", "pinned_at")} for w in workers)
    return tuple((k, round(v, 3)) for k, v in out), per_worker


def _forget_worker_status(pids: list[int]) -> None:
    """Delete the status files of workers that are gone (they would pile up otherwise)."""
    for pid in pids:
        slots.worker_status_path(pid).unlink(missing_ok=True)
        slots.worker_counters_path(pid).unlink(missing_ok=True)


# -- the swap ------------------------------------------------------------------


_ORDER = ("create", "register", "ready", "set_default", "drain", "retire")


class _Phases:
    """A swap's record as it goes: each phase timed, `on_phase` told as the next begins."""

    def __init__(self, record: SwapRecord, clock: Callable[[], float],
                 on_phase: Callable[[SwapRecord], None] | None) -> None:
        self.record = record
        self.clock = clock
        self.on_phase = on_phase
        self.timed: list[tuple[str, float]] = []
        self.warnings: list[str] = []
        self.t0 = self.mark = clock()

    def begin(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(replace(self.record, phase=name, phases_s=tuple(self.timed)))

    def end(self, name: str) -> None:
        now = self.clock()
        self.timed.append((name, round(now - self.mark, 3)))
        self.mark = now
        nxt = _ORDER.index(name) + 1
        if nxt < len(_ORDER):
            self.begin(_ORDER[nxt])

    def split_retire(self, unregister_s: float) -> None:
        """The last phase, retire, as retire + unregister (the call inside it, and what followed)."""
        _, retire_s = self.timed.pop()
        unregister_s = min(retire_s, unregister_s)
        self.timed.append(("retire", round(retire_s - unregister_s, 3)))
        self.timed.append(("unregister", round(unregister_s + self.clock() - self.mark, 3)))

    def finish(self, outcome: str, error: str | None = None) -> SwapRecord:
        return replace(self.record, outcome=outcome, error=error, phases_s=tuple(self.timed),
                       warnings=tuple(self.warnings), duration_s=round(self.clock() - self.t0, 3))


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
        self.last_unregister_s = 0.0  # the last retire()'s unregister call (a phase of the swap record)

    # The default version and what directory it was registered from.
    def current(self, model: str) -> tuple[str, str]:
        d = self.client.describe_model(model)
        return d.version, d.url

    def base_of(self, url: str) -> str:
        """The base model directory behind a registered url (itself, or a Packrat version's base)."""
        path = self.model_store / url
        vdir = versions.load_version(path) if (path / versions.MANIFEST).exists() else None
        return vdir.base if vdir else url

    def apply(
        self, model: str, plan: Plan, on_phase: Callable[[SwapRecord], None] | None = None,
        cores: Sequence[int] | None = None, current: tuple[str, str] | None = None,
    ) -> SwapRecord:
        """Make `plan` the live shape of `model`. Returns the record; raises SwapError on failure.

        `on_phase(record)` is called as each phase begins, with `record.phase` naming it
        (create, register, ready, set_default, drain, retire) and the phases done so far.
        `current`: (version, url) of the default version, when the caller just read it
        (the controller does, under its swap lock); else it is read here.
        """
        # `cores`: the model's own cores when the controller divides them among models.
        use_cores = list(cores) if cores is not None else self.cores
        versions.validate_plan(plan, len(use_cores))  # ConfigError: nothing touched yet
        old_version, old_url = current or self.current(model)
        p = _Phases(SwapRecord(model=model, from_version=old_version, to_version=None, plan=plan,
                               started_at=time.time()), self.clock, on_phase)
        p.begin("create")
        vdir = versions.create_version(self.model_store, self.base_of(old_url), model, plan, use_cores,
                                       max_batch_delay_ms=self.settings.max_batch_delay_ms)
        p.record = replace(p.record, to_version=vdir.version)
        p.end("create")
        self._go_live(model, old_version, vdir, p)
        self._retire_old(model, old_version, old_url, p)
        return p.finish("applied")

    def _go_live(self, model: str, old_version: str, vdir: VersionDir, p: _Phases) -> None:
        """register -> ready -> set-default -> drain the old version; on failure roll back
        and raise SwapError with the record."""
        s = self.settings
        defaulted = False
        try:
            self.client.register(vdir.url, model, len(vdir.slots), timeout_s=s.register_timeout_s)
            register_end = time.time()
            p.end("register")
            ready = self._wait_ready(model, vdir)
            ready_phases, started = startup_breakdown(
                [slots.read_worker_status(c.pid) for c in ready], register_end, time.time())
            p.record = replace(p.record, ready_phases_s=ready_phases, workers=started)
            p.end("ready")
            self.client.set_default(model, vdir.version)
            defaulted = True
            # The new version is live from here on (what the issue times a swap by).
            p.record = replace(p.record, live_s=round(self.clock() - p.t0, 3))
            p.end("set_default")
            self.drain(model, old_version, min_s=s.min_drain_s)
            p.end("drain")
        except (TorchServeError, SwapError, ConfigError) as exc:
            outcome = self._rollback(model, old_version, vdir, defaulted, p.warnings)
            failed = p.finish(outcome, f"{type(exc).__name__}: {exc}")
            raise (ModeRefusedError if isinstance(exc, ModeRefusedError) else SwapError)(
                f"swap of {model} {old_version} -> {vdir.version} failed "
                f"({outcome.replace('_', ' ')}): {exc}",
                record=failed,
            ) from exc

    def _retire_old(self, model: str, old_version: str, old_url: str, p: _Phases) -> None:
        """Past the point of no return: the new version serves. Clean-up failures are warnings."""
        try:
            returned = self.retire(model, old_version, drain_first=False)
            if returned:
                p.warnings.append(f"{returned} job(s) came back from {old_version}'s workers and were served again")
        except (TorchServeError, SwapError) as exc:
            p.warnings.append(f"old version {old_version} not retired: {exc}")
        p.end("retire")
        if self._registered(model, old_version) is False:
            self.retire_dir(old_url)
        else:
            p.warnings.append(f"old version {old_version} still registered; {old_url} kept")
        # The unregister call ran inside retire(): reported as a phase of its own,
        # with the check that it is gone and the version directory's removal.
        p.split_retire(self.last_unregister_s)

    # -- phases ------------------------------------------------------------------

    def _wait_ready(self, model: str, vdir: VersionDir) -> list[WorkerCheck]:
        deadline = self.clock() + self.settings.ready_timeout_s
        last: list[WorkerCheck] = []
        pids_by_worker: dict[str, set[int]] = {}
        while self.clock() < deadline:
            d = self.client.describe_model(model, vdir.version)
            last = check_workers(d, vdir)
            if len(last) == len(vdir.slots) and all(c.ok for c in last):
                return last
            # A wrong pin will not fix itself; a missing status might (worker still loading).
            wrong = [c for c in last if c.ready and c.why and "no status" not in c.why]
            if wrong:
                raise SwapError(f"workers of {model} {vdir.version} not as planned: {[c.why for c in wrong]}")
            # TorchServe restarts a worker that dies while loading, forever (with back-off).
            for w in d.workers:
                if w.pid > 0:
                    pids_by_worker.setdefault(w.id, set()).add(w.pid)
            errors = load_errors(pid for pids in pids_by_worker.values() for pid in pids)
            refused = [e for e in errors if is_mode_refusal(e)]
            if refused:  # the guard's verdict is cached: every restart would refuse it again
                raise ModeRefusedError(f"workers of {model} {vdir.version} refused mode "
                                       f"{vdir.plan.mode or 'of the base archive'}: {refused[0]}")
            dying = {k: sorted(v) for k, v in pids_by_worker.items() if len(v) >= self.settings.max_worker_starts}
            if dying:
                why = f": {errors[0]}" if errors else ""
                raise SwapError(
                    f"workers of {model} {vdir.version} keep dying while loading{why} (worker id: pids {dying}); "
                    "see TorchServe's model_log.log"
                )
            time.sleep(self.settings.poll_s * 2)  # ready_check: how late the swap sees READY
        raise SwapError(
            f"workers of {model} {vdir.version} not READY and pinned after "
            f"{self.settings.ready_timeout_s:.0f}s: {[(c.pid, c.why) for c in last]}"
        )

    def drain(self, model: str, version: str, min_s: float = 0.0, *, expect_jobs: int = 0,
              fresh_workers: bool = False) -> None:
        """Return once `version` has an empty queue and no batch in flight, stably,
        and not before `min_s` (the grace after set-default, SwapSettings.min_drain_s).

        `expect_jobs`: jobs known to be in its queue before the first poll (retire()
        after jobs came back); `fresh_workers`: its workers started after those
        jobs were queued, so every batch they started counts."""
        s = self.settings
        began = self.clock()
        deadline = began + s.drain_timeout_s
        # A worker may hold jobs it took from the queue for up to maxBatchDelay while
        # it fills its batch; after that they are in flight and the counters see them.
        quiet_needed = s.drain_quiet_s
        quiet_since: float | None = None
        last_snapshot: Any = None
        # Jobs seen queued must have been taken into batches that a worker *started*
        # before the version counts as drained: between the frontend taking a job and
        # the Python worker entering predict (a worker starved of CPU: seconds), the
        # queue is empty and every counter says idle. Batches started since the drain
        # began, per pid (a worker that appears later counts from its start).
        seen_jobs = expect_jobs
        first_started: dict[int, int] = {}
        last_started: dict[int, int] = {}
        first_poll = not fresh_workers
        while self.clock() < deadline:
            d = self.client.describe_model(model, version)
            quiet_needed = max(s.drain_quiet_s, 2 * d.max_batch_delay_ms / 1000.0)
            snapshot = self._in_flight_snapshot(d)
            if first_poll:
                # The baseline counters are read after this describe: jobs it counted as
                # queued may have started in between. Count the queue again, after them.
                d = self.client.describe_model(model, version)
            pending = d.pending_requests
            seen_jobs = max(seen_jobs, pending)
            counted = True  # every READY worker keeps a status file
            for key, _ in snapshot or ():
                if len(key) == 3:
                    pid, started = key[0], key[1]
                    first_started.setdefault(pid, started if first_poll else 0)
                    last_started[pid] = max(last_started.get(pid, 0), started)
                else:
                    counted = False
            first_poll = False
            batches = sum(last_started[p] - first_started[p] for p in last_started)
            covered = not counted or batches * max(1, d.batch_size) >= seen_jobs
            idle = pending == 0 and covered and snapshot is not None and all(x[1] for x in snapshot)
            now = self.clock()
            if idle and snapshot == last_snapshot:
                if quiet_since is not None and now - quiet_since >= quiet_needed and now - began >= min_s:
                    return
            else:
                quiet_since = now if idle else None
            last_snapshot = snapshot if idle else None
            time.sleep(s.poll_s)
        raise SwapError(f"{model} {version} did not drain within {s.drain_timeout_s:.0f}s")

    @staticmethod
    def _in_flight_snapshot(described: ModelDescription) -> tuple[tuple[Any, bool], ...] | None:
        """Per READY worker: (a counter that moves with every batch, idle?).

        Only READY workers: TorchServe hands batches only to a worker whose model
        is loaded, and a worker still loading (e.g. left by a killed swap) burns
        CPU without holding a job.
        """
        out = []
        queues = unix_receive_queues()
        for pid in (w.pid for w in described.ready_workers() if w.pid > 0):
            status = slots.read_worker_status(pid)
            if status is not None:
                started, done = int(status["started"]), int(status["done"])
                # A batch still unread in the worker's socket is in flight too.
                unread = unread_bytes(pid, queues) or 0
                out.append(((pid, started, done), started == done and not status.get("busy") and unread == 0))
            else:
                ticks = proc_cpu_ticks(pid)
                if ticks is None:
                    continue  # process gone
                # Fallback: idle means the CPU time stands still across the quiet window
                # (and nothing waits unread in its socket).
                out.append(((pid, ticks), not unread_bytes(pid, queues)))
        return tuple(out)

    # -- retiring a version ------------------------------------------------------------

    def retire(self, model: str, version: str, *, drain_first: bool = True, min_drain_s: float = 0.0) -> int:
        """Take `version` out of service without dropping a job it accepted, and unregister it.

        Each round: drain (queue empty, no batch counted in flight), scale to 0
        workers synchronously (a worker's held jobs go back into the queue), then
        describe: an empty queue -> unregister; jobs back in the queue -> scale up
        again to serve them and start the next round. `drain_first=False` skips
        the first drain (the caller just drained, or the version never had
        traffic). Returns how many jobs came back and were served again; raises
        SwapError after SwapSettings.retire_attempts rounds (the version then
        stays registered with workers, serving whatever it holds).
        """
        s = self.settings
        returned = 0
        workers = 0
        came_back = 0
        for attempt in range(s.retire_attempts):
            d = self.client.describe_model(model, version)
            if d.workers:
                workers = max(workers, len(d.workers))
                drained = attempt > 0 or drain_first
                if attempt > 0:
                    # The workers were started to serve the jobs that came back: wait until
                    # they have taken them into batches they started, not just off the queue.
                    self.drain(model, version, expect_jobs=came_back, fresh_workers=True)
                elif drain_first:
                    self.drain(model, version, min_s=min_drain_s)
                # Described again only after a drain (it takes time: a worker may have been replaced).
                pids = (self.client.describe_model(model, version) if drained else d).worker_pids()
                self._scale_to_zero(model, version, s.scale_timeout_s)
                _forget_worker_status(pids)
                d = self.client.describe_model(model, version)
            pending = d.pending_requests
            if pending == 0 and not d.workers:
                t = self.clock()
                self.client.unregister(model, version)
                self.last_unregister_s = self.clock() - t
                return returned
            returned += pending
            came_back = pending
            # Jobs came back (or were enqueued late): serve them before the next round.
            self._scale_up(model, version, workers or self._planned_workers(d))
        raise SwapError(
            f"{model} {version} still had queued jobs after {s.retire_attempts} rounds of "
            "scale to 0 / scale up; left registered"
        )

    def _scale_to_zero(self, model: str, version: str, timeout_s: float) -> None:
        """Scale a version to 0 workers; a 5xx is left to the next round of retire().

        TorchServe 0.12 may answer a scale-down that races a batch in flight with HTTP 500
        ("Cannot invoke Job.isControlCmd() because job is null", seen in
        tests/test_reliability_faults.py with a worker holding a job); retire() describes
        the version again and scales up, drains and scales down once more."""
        try:
            self.client.scale(model, version, 0, synchronous=True, timeout_s=timeout_s)
        except TorchServeError as exc:
            if exc.status < 500:
                raise
            log.warning("scale of %s %s to 0 failed (%s); retrying in the next round", model, version, exc)

    def _planned_workers(self, described: ModelDescription) -> int:
        """Workers a version runs with: its plan's instances (Packrat version), else 1."""
        path = self.model_store / described.url
        try:
            vdir = versions.load_version(path) if (path / versions.MANIFEST).exists() else None
        except ConfigError:
            vdir = None
        return len(vdir.slots) if vdir is not None else 1

    def _scale_up(self, model: str, version: str, workers: int) -> None:
        """Start `workers` workers (asynchronous call: see ManagementClient.register) and wait until READY."""
        self.client.scale(model, version, workers, synchronous=False)
        deadline = self.clock() + self.settings.ready_timeout_s
        while self.clock() < deadline:
            d = self.client.describe_model(model, version)
            if len(d.ready_workers()) >= workers:
                return
            time.sleep(self.settings.poll_s * 4)
        raise SwapError(f"{model} {version}: {workers} worker(s) not READY after scaling up to serve returned jobs")

    def _registered(self, model: str, version: str) -> bool | None:
        """Does TorchServe list `version` of `model`? None when it cannot be asked."""
        try:
            return any(d.version == version for d in self.client.describe_versions(model))
        except TorchServeError as exc:
            if exc.status == 404:
                return False  # no version of the model at all
            return None

    def _rollback(
        self, model: str, old_version: str, vdir: VersionDir, defaulted: bool, warnings: list[str]
    ) -> str:
        outcome = "rolled_back"
        try:
            if defaulted:
                self.client.set_default(model, old_version)
            if self._registered(model, vdir.version) is not False:
                # Before set-default the new version had no traffic: nothing to drain.
                # After it, requests routed to it just before set-default back get the grace.
                self.retire(model, vdir.version, drain_first=defaulted,
                            min_drain_s=self.settings.min_drain_s if defaulted else 0.0)
        except (TorchServeError, SwapError) as exc:
            warnings.append(f"rollback incomplete: {exc}")
            outcome = "failed"
        # Never delete what TorchServe still lists: its workers restart from that directory.
        if self._registered(model, vdir.version) is False:
            versions.remove_version(vdir.path)
            self._forget_slots(vdir.plan_id)
        else:
            warnings.append(f"{vdir.version} may still be registered; {vdir.path.name} kept")
            outcome = "failed"
        return outcome

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
