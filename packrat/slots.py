"""The worker side of a plan: which cores and how many threads a process gets.

Runs inside the processes that execute a model: TorchServe's Python worker
(through the handler's claim_and_pin()) and the profiler's isolated worker
(packrat/profile/worker.py). Both pin with the same recipe, pin_process(), and
report what they really run with through the same observed_settings(): a plan
is only as true as the profile it was computed from, so a profiled process and
a served process on the same slot must run with identical thread settings.
This module therefore imports nothing from the controller side and, at import
time, neither torch nor numpy (the profiler imports it before it pins).

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

In TorchServe's worker this runs in the handler's initialize(), before the
model is loaded (so the model's pools and memory start on the right cores).

Every worker whose handler calls claim_and_pin() (with or without a plan)
also keeps a small status file, `<slot dir>/workers/<pid>.json`: its slot,
cores and threads, the thread settings it actually runs with (as of its start-up
report), and beside it `<pid>.live`, how many batches it has started and
finished (a mapped file updated in place: packrat/worker_counters.py). The controller reads it for two things
TorchServe's API does not tell: that a worker is pinned as planned, and
whether it still has a batch in flight (TorchServe 0.12 reports only
READY/UNLOADING per worker).

The slot dir ($PACKRAT_SLOT_DIR, default `$TMPDIR/packrat-slots-<uid>`: per user,
so another user who creates the name first can only lock themselves out) decides where
a worker pins itself and what the controller believes about in-flight batches,
so nobody else may write into it: writers create it 0700, tighten an existing
one of theirs that others could only read, and refuse one that is a symlink,
another user's, or writable by others. Every file in it is opened with
O_NOFOLLOW, and a status file not owned by this user is ignored. The
controller therefore runs as the user TorchServe's workers run as (it reads
their status files).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packrat import settings
from packrat.cpulist import cpus_allowed_list, parse_cpu_list  # noqa: F401 - re-exported for readers of slots
from packrat.errors import ConfigError
from packrat.tslog import worker_request_lines_quiet
from packrat.worker_counters import LiveCounters, SizeHistogram, read_counters, read_sizes
from packrat.worker_messages import FrontendReader, read_message

# Pool sizes that the numeric libraries read from the environment when they
# start: OpenMP (torch's intra-op pool), MKL, OpenBLAS (numpy/scipy) and Rayon
# (Hugging Face tokenizers).
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")

# Kept open for the life of the worker process: closing it would free the slot.
_held_lock_fd: int | None = None


# -- the pinning recipe (shared by the served and the profiled worker) ----------


def pin_threads(cores: Iterable[int], threads: int) -> None:
    """Pin every thread of this process to `cores` and set THREAD_VARS to `threads`.

    Imports nothing, so a fresh process can call it before torch, numpy or
    scipy are imported and every pool they start is born on these cores at
    this size. sched_setaffinity(0) only moves the calling thread, so threads
    that already exist (TorchServe's, or a pool torch started early) are moved
    one by one; threads started later inherit the affinity. A worker forked by
    packrat.forkserver has torch imported but no pool started (the fork server has
    one thread when it forks, tests/test_forkserver.py), so the same holds there.
    """
    core_set = set(cores)
    os.sched_setaffinity(0, core_set)
    _each_thread(lambda tid: os.sched_setaffinity(tid, core_set))
    for var in THREAD_VARS:
        os.environ[var] = str(threads)


def set_torch_threads(threads: int) -> None:
    """Size torch's pools: `threads` intra-op threads, one inter-op thread.

    One inter-op thread because a worker runs one batch at a time; more would
    only be threads competing for the slot's cores.
    """
    import torch  # imported here: importing this module must not start torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # inter-op pool already started; observed_settings() reports what it is


def pin_process(cores: Iterable[int], threads: int) -> None:
    """The whole recipe: pin_threads() (before torch is imported), then set_torch_threads()."""
    pin_threads(cores, threads)
    set_torch_threads(threads)


# Extra nice value for a new worker's load and warm-up: they run on the cores the
# version being replaced serves on. By the CFS weights (335 : 1024) 5 leaves the loader
# about a quarter of a core beside a busy serving thread; chosen by measuring 0, 5 and 10
# on the 2-core EPYC (docs/live-plans.md). 0 leaves the priority alone. The value and
# its variable: packrat.settings, "load_nice".
_CAP_SYS_NICE = 23


def _each_thread(action: Callable[[int], object]) -> None:
    """`action(tid)` for every thread of this process (pinning and priority are per thread)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            action(int(tid))
        except (ProcessLookupError, PermissionError):
            pass  # thread exited meanwhile


def can_restore_priority(nice: int) -> bool:
    """Whether this process may go back from `nice` to a lower value (CAP_SYS_NICE or RLIMIT_NICE)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or 20 - soft <= nice:
        return True
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except OSError:
        pass
    return False


class lowered_priority:
    """Run a block `extra` nice levels lower, every thread (pools started inside too), then restore.

    Only where the way back is allowed: an unprivileged process may raise its nice
    value but not lower it again, and a serving worker must not stay deprioritised.
    `active` says whether it applied.
    """

    def __init__(self, extra: int | None = None) -> None:
        if extra is None:
            extra = settings.value_or_default("load_nice")  # a worker must load anyway
        self.extra = max(0, min(extra, 19))
        self.before = os.getpriority(os.PRIO_PROCESS, 0)
        self.active = self.extra > 0 and can_restore_priority(self.before)

    def __enter__(self) -> "lowered_priority":
        if self.active:
            _each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, min(19, self.before + self.extra)))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            _each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, self.before))


def thread_cpu_lists() -> list[str]:
    """Distinct Cpus_allowed_list values over all threads of this process (pools included)."""
    seen = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            seen.add(cpus_allowed_list(f"/proc/self/task/{tid}/status"))
        except OSError:
            pass  # thread exited meanwhile
    return sorted(seen)


def observed_settings() -> dict[str, Any]:
    """What this process really runs with, read now (not what was asked for).

    Affinity of the process and of every thread, torch's intra-op and
    inter-op thread counts, and THREAD_VARS (None when unset). Imports torch:
    call it once torch's pools are set. Reads /proc for every thread, so it is
    not for a per-batch path.
    """
    import torch

    return {
        "cpus_allowed_list": cpus_allowed_list(),
        "thread_cpu_lists": thread_cpu_lists(),
        "torch_threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "thread_env": {var: os.environ.get(var) for var in THREAD_VARS},
    }


# -- slots of a plan --------------------------------------------------------------


@dataclass(frozen=True)
class SlotClaim:
    index: int
    cores: tuple[int, ...]
    threads: int
    lock_path: str


def slot_root() -> Path:
    return settings.value("slot_dir")  # $PACKRAT_SLOT_DIR, else $TMPDIR/packrat-slots-<uid>


def secure_dir(path: Path) -> Path:
    """Create `path` 0700, or accept it if it is already a private directory of this user.

    An existing directory of ours that others may read but not write is
    tightened to 0700. ConfigError for a symlink, a non-directory, another
    user's directory, or one that others may write into (they could plant
    lock files or status records, or symlinks where ours go).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create the slot directory {path}: {exc}") from exc
    st = os.lstat(path)
    why = None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        why = "is not a directory (a symlink?)"
    elif st.st_uid != os.getuid():
        why = f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        why = f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if why:
        raise ConfigError(
            f"slot directory {path} {why}; remove it or set PACKRAT_SLOT_DIR to a private directory"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def _open_private(path: Path, flags: int) -> int:
    """os.open without following a symlink at `path`, files created 0600."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{path} is a symlink; refusing to follow it") from exc
        raise


def slot_lock_dir(plan_id: str) -> Path:
    return slot_root() / plan_id


def worker_status_path(pid: int) -> Path:
    return slot_root() / "workers" / f"{pid}.json"


def worker_counters_path(pid: int) -> Path:
    """The worker's batch counters, updated in place (packrat/worker_counters.py)."""
    return slot_root() / "workers" / f"{pid}.live"


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
    secure_dir(slot_root())
    lock_dir = secure_dir(slot_lock_dir(plan_id))
    for index, (cores, threads) in enumerate(slots):
        path = lock_dir / f"slot-{index}.lock"
        fd = _open_private(path, os.O_RDWR | os.O_CREAT)
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


class _WorkerStatus:
    """Writes this worker's status file; one instance per worker process."""

    def __init__(self, claim: SlotClaim | None) -> None:
        self.claim = claim
        self.path = worker_status_path(os.getpid())
        secure_dir(slot_root())
        secure_dir(self.path.parent)
        self.started = 0
        self.done = 0
        # Per batch only these change: kept in a mapped file, not by rewriting the JSON.
        self.counters = LiveCounters(worker_counters_path(os.getpid()))
        # Observed once, right after pinning: reading every thread's /proc entry
        # costs ~0.05 ms per thread, twice per batch if it were done in write().
        self.settings = observed_settings()
        # Start-up timeline (wall-clock seconds, and phase durations the handler
        # reports): the swap reads it while it waits for READY and records where
        # a worker's start-up time went (docs/live-plans.md, "Where a swap's time goes").
        self.startup: dict[str, Any] = {"process_started_at": process_start_time()}

    def write(self, busy: bool) -> None:
        import torch

        claim = self.claim
        record = {
            **self.settings,
            "pid": os.getpid(),
            "plan_id": None if claim is None else Path(claim.lock_path).parent.name,
            "slot": None if claim is None else claim.index,
            "cores": None if claim is None else list(claim.cores),
            "threads": None if claim is None else claim.threads,
            # What the worker really runs with, not what was asked for: the settings
            # observed at start, and these two re-read at this moment (cheap).
            "torch_threads": torch.get_num_threads(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "started": self.started,
            "done": self.done,
            "busy": busy,
            "time": time.time(),
            "startup": self.startup,
        }
        # Write-then-rename so a reader never sees half a record.
        tmp = self.path.with_suffix(".tmp")
        fd = _open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record))
        os.replace(tmp, self.path)

    def batch_started(self) -> None:
        self.started += 1
        self.counters.store(self.started, self.done, busy=True)

    def batch_done(self) -> None:
        self.done += 1
        self.counters.store(self.started, self.done, busy=False)

    @property
    def in_flight(self) -> bool:
        return self.started > self.done


_status: _WorkerStatus | None = None


def process_start_time(pid: int | str = "self") -> float | None:
    """Wall-clock time a process was created (to ~10 ms), from /proc/<pid>/stat's starttime.

    starttime counts clock ticks since boot (CLOCK_BOOTTIME), so it is mapped
    through the boot clock read now rather than /proc/stat's btime (whole seconds).
    """
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(rest[19])  # field 22 of stat; rest starts at field 3
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - age


def report_startup(**fields: Any) -> None:
    """Add start-up facts to this worker's status file (no-op outside a claimed worker).

    The handler calls it once its task is loaded: `loaded_at` (wall clock),
    `phases` ({model_load, mode_build, guard, warmup: seconds}) and `cache`
    (what the build cache gave: hit or built, per artefact).
    """
    status = _status
    if status is None:
        return
    status.startup.update(fields)
    status.write(busy=status.in_flight)


def record_sizes(sizes: dict[str, list[int]]) -> None:
    """Count the sizes of what this worker served in a batch, {kind: [size per request]}
    (packrat.worker_counters.SIZE_KINDS), in its mapped counters: a few stores, no system
    call; a no-op outside a claimed worker (the profiler, tests). Never fails the batch."""
    status = _status
    if status is None or not sizes:
        return
    try:
        status.counters.add_sizes(sizes)
    except (AttributeError, TypeError, ValueError, OverflowError):  # not a size (a float?), or a sum past 2^64
        pass


def read_worker_sizes(pid: int) -> dict[str, SizeHistogram] | None:
    """The sizes worker `pid` served since it started, per kind; None: none readable."""
    return read_sizes(worker_counters_path(pid))


def read_worker_status(pid: int) -> dict[str, Any] | None:
    """The status record of worker `pid`, or None if it has none (yet).

    Only a regular file of this user counts (opened without following a symlink).
    started, done, busy and time come from the worker's counter file when it has
    one (updated every batch; the JSON only when the worker starts and reports).
    """
    try:
        fd = os.open(worker_status_path(pid), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                return None
            record = json.loads(f.read(1_000_000))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("pid") != pid:
        return None
    counters = read_counters(worker_counters_path(pid))
    return record if counters is None else {**record, **counters}


_reader: FrontendReader | None = None


def _frontend_reader(conn: Any) -> FrontendReader:
    """The one FrontendReader of the worker's connection (a new one for another socket)."""
    global _reader
    if _reader is None or _reader.sock is not conn:
        _reader = FrontendReader(conn)
    return _reader


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
    # The worker's loop (ts/model_service_worker.py, run as __main__) sends a
    # batch's answer after predict returns, then asks for the next message. A
    # worker stopped or killed in between still owes the frontend its answer,
    # so the batch counts as done when the loop asks for the next message.
    main = sys.modules.get("__main__")
    receive = getattr(main, "retrieve_msg", None)
    done_on_next_receive = callable(receive)
    if done_on_next_receive:

        def retrieve_msg(conn: Any) -> Any:
            status = _status
            if status is not None and status.in_flight:
                status.batch_done()
            # The load message came through the socket itself (this is installed while the
            # model loads), so no byte of it is left in a buffer. read_message gives what
            # TorchServe's parser gives at under half its cost (docs/live-plans.md).
            return read_message(_frontend_reader(conn), log_request_line=not worker_request_lines_quiet())

        main.retrieve_msg = retrieve_msg  # type: ignore[union-attr]

    def predict(self: Any, batch: Any) -> Any:
        status = _status
        if status is not None:
            status.batch_started()
        try:
            return original(self, batch)
        finally:
            if status is not None and not done_on_next_receive:
                status.batch_done()

    predict._packrat_tracked = True  # type: ignore[attr-defined]
    Service.predict = predict  # type: ignore[method-assign]


def claim_and_pin(model_yaml_config: dict[str, Any] | None) -> SlotClaim | None:
    """Entry point for the handler. Returns None for a version without a Packrat plan."""
    global _status
    initialize_at = time.time()
    packrat_cfg = (model_yaml_config or {}).get("packrat") or {}
    claim = None
    if "slots" in packrat_cfg:
        claim = claim_slot(packrat_cfg)
        pin_process(claim.cores, claim.threads)
    # Tracked even without a plan: the first swap away from a plain version drains it too.
    _status = _WorkerStatus(claim)
    # pinned_at: torch is imported and sized; the model load starts now.
    _status.startup.update(initialize_at=initialize_at, pinned_at=time.time())
    _status.write(busy=False)
    _track_batches()
    return claim
