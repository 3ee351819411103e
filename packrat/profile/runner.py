"""The profiling driver: one pinned worker process per thread count, results as they land.

    for t in 1..T:                                   # cores[:t] of the usable cores
        start `python -m packrat.profile.worker` pinned to t cores
        it loads the model once and times b = 1, 2, 4, ... max_batch
        each point is recorded (and on_update called) the moment it arrives
    then, co-run (settings.corun), for every t with i = T // t >= 2:
        start i such workers at once, worker k pinned to cores[k*t : (k+1)*t]
        each times the same batches; the co-run figure of (i, t, b) is the
        slowest instance's (it sets a uniform plan's latency)

Co-run figures exist because instances side by side are slower than one
alone (shared caches and memory bandwidth; the Packrat paper saw 12-15 %), and
the isolated figure therefore favours thin plans. The instances are not
synchronised batch by batch: each runs the same list under the same stop rule,
so they overlap for nearly all of a run, and every one of them keeps the
machine's other cores busy while the others are timed.

Total budget: with co-run on, the isolated runs get (1 - corun_share) of it
and the co-run runs the rest plus whatever the isolated ones left. Within each
phase the time left is shared among the thread counts still to run
in proportion to 1/t (a 1-thread instance is roughly t times slower than a
t-thread one, so it needs the larger share); time a worker does not use goes
to the next ones. Inside a worker, batch sizes run smallest first, so when a
budget runs out it is the largest batches that are omitted — those the
optimiser can still reach by composing smaller ones. A tune orders them itself
(the caps its batch B needs first) and names B (`plan_batch`): each t-thread
worker then starts at the cap of a plan of T // t such workers, so fat's own
figure at B, the one the optimiser's noise guard compares every plan with, is
the T-thread worker's first. Omitted points are listed with the reason, never
estimated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from packrat.cores import usable_cores
from packrat.errors import ConfigError, ProfileError
from packrat.forkserver import client as forkserver_client
from packrat.profile import contention
from packrat.profile.fingerprint import current_fingerprint
from packrat.profile.identity import ArchiveRef
from packrat.profile.store import SCOPES, utc_now
from packrat.settings import SETTINGS
from packrat.types import Profile, ProfilePoint

DEFAULT_MAX_BATCH: int = SETTINGS["profile_max_batch"].default
DEFAULT_POINT_BUDGET_S: float = SETTINGS["profile_point_budget_s"].default
# The descriptor a forked worker writes its events to (a started one gets the pipe's own number).
_RESULT_FD = 3
# What every profiling worker imports (torch after pinning, numpy and scipy for its stop rule):
# the fork server has it imported before its first fork (no thread pool started: see _pin).
_WORKER_PRELOAD = ("numpy", "torch", "scipy.stats")
# Runtimes whose workers load a built graph from the build cache, without transformers.
_CACHED_RUNTIMES = ("onnxruntime", "openvino")


def model_preload(config: Mapping[str, Any], archive_dir: str) -> tuple[str, ...]:
    """What a worker of the archive at `archive_dir` (its model_config.yaml: `config`) imports
    beyond numpy and torch to load its model: nothing for noop; the model family's code
    (config.json's model_type) for a model built by transformers, unless its runtime loads
    a graph from the build cache (the first worker, which builds it, imports transformers
    itself); the tokenizer or PIL for text or images."""
    section = config.get("packrat")
    if not isinstance(section, Mapping) or section.get("task") in (None, "noop"):
        return ()
    task = section["task"]
    modules = ["PIL.Image"] if task == "image-classification" else ["tokenizers"]
    if task == "text-generation" or section.get("runtime", "eager") not in _CACHED_RUNTIMES:
        modules += ["transformers", "transformers.modeling_utils"]
        try:
            model_config = Path(archive_dir, str(section.get("model_dir", "model")), "config.json")
            family = str(json.loads(model_config.read_text()).get("model_type", "")).replace("-", "_")
        except (OSError, ValueError, AttributeError):
            family = ""
        if family.isidentifier():
            modules.append(f"transformers.models.{family}.modeling_{family}")
        modules.append("safetensors.torch")
    return tuple(modules)


@dataclass(frozen=True)
class ProfileSettings:
    cores: int  # T: thread counts 1..T are profiled
    max_batch: int = DEFAULT_MAX_BATCH
    budget_s: float | None = None  # whole run, model loading included; None = no limit
    point_budget_s: float = DEFAULT_POINT_BUDGET_S  # one (t, b), warm-up included
    scope: str = "handler"  # "handler" (pre+forward+post) or "model" (forward only)
    rel_ci: float = 0.05
    confidence: float = 0.95
    min_count: int = 5
    # Batch sizes in the order to measure them; None: batch_sizes(max_batch), smallest first.
    # A tune puts the caps its batch needs first, so a short budget cuts the others.
    batches: tuple[int, ...] | None = None
    # The load batch B a tune profiles for (None: none). Each t-thread worker then times
    # first the cap a plan of T // t such workers needs, ceil(B / (T // t)) (for t = T,
    # fat's own B: the figure the optimiser's noise guard compares every plan with),
    # then `batches` in their order (worker_batches).
    plan_batch: int | None = None
    # Co-run figures for every uniform shape <T // t, t> with at least 2 instances, within
    # the same budget (corun_share of it) and the same stop rule per point.
    corun: bool = True
    corun_share: float = 0.3
    # The request size per kind to time ((kind, size) pairs: packrat.worker_counters.SIZE_KINDS),
    # e.g. the traffic's own (packrat.profile.shape); (): the task's sample. The profile's
    # settings keep the sizes timed instead (_Run.timed_sizes: these, and the sample's own
    # for every other kind): the input shape its figures are for.
    sizes: tuple[tuple[str, int], ...] = ()
    # Batch sizes timed at other sizes than `sizes` ((batch, sizes) pairs: a batch of b of the
    # traffic is padded to the largest of b requests, packrat.profile.shape.sizes_by_batch);
    # `sizes` stays the profile's label, the shape it is for.
    sizes_by_batch: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = ()

    def validate(self, usable: int) -> None:
        if self.cores < 1:
            raise ConfigError(f"--cores must be >= 1, got {self.cores}")
        if self.cores > usable:
            raise ConfigError(f"--cores {self.cores} exceeds the {usable} cores this process may use")
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {self.max_batch}")
        if not 0.0 < self.corun_share < 1.0:
            raise ConfigError(f"corun_share must be in (0, 1), got {self.corun_share}")
        if self.budget_s is not None and self.budget_s <= 0:
            raise ConfigError(f"--budget must be > 0 seconds, got {self.budget_s}")
        if self.point_budget_s <= 0:
            raise ConfigError(f"--point-budget must be > 0 seconds, got {self.point_budget_s}")
        if self.batches is not None and (not self.batches or min(self.batches) < 1):
            raise ConfigError(f"batches must be >= 1, got {self.batches}")
        if self.scope not in SCOPES:
            raise ConfigError(f"--scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")


def worker_batches(batches: list[int], plan_batch: int | None, threads: int, cores: int) -> list[int]:
    """The order a `threads`-thread worker times `batches` in (see ProfileSettings.plan_batch)."""
    if plan_batch is None:
        return list(batches)
    first = -(-plan_batch // max(1, cores // threads))
    return ([first] if first in batches else []) + [b for b in batches if b != first]


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch; max_batch itself is added when it is no power of two."""
    out, b = [], 1
    while b <= max_batch:
        out.append(b)
        b *= 2
    if out[-1] != max_batch:
        out.append(max_batch)
    return out


def budget_share(remaining_s: float, t: int, cores: int) -> float:
    """Share of the remaining budget for thread count t, given t..cores still to run."""
    weights = [1.0 / k for k in range(t, cores + 1)]
    return remaining_s * weights[0] / sum(weights)


class _Progress:
    """tqdm bar over all points; silent when disabled."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="pt", dynamic_ncols=True, file=sys.stderr)

    def at(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    def step(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_worker(
    job: dict[str, Any],
    on_event: Callable[[dict[str, Any]], None],
    log_path: Path,
) -> None:
    """Run one worker to completion, passing its events on; ProfileError if it fails.

    Forked warm by this process's fork server (packrat.forkserver.client) where there is
    one, as TorchServe's workers are; otherwise started as a new interpreter.
    """
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(job["threads"])  # also set by the worker, before torch
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # don't write __pycache__ into the archive directory
    with tempfile.NamedTemporaryFile("w", prefix=f"packrat-profile-job-{os.getpid()}-", suffix=".json",
                                     delete=False) as jf:
        # The worker's budget runs from now, not from when it got going: a fork waits
        # for the fork server's imports the first time, a new interpreter for its own.
        json.dump({**job, "issued_monotonic": time.monotonic()}, jf)
    error: str | None = None
    try:
        with open(log_path, "ab") as log, open(os.devnull, "rb") as devnull:
            # The fork server imports what this archive's worker needs (no transformers for
            # noop) before it forks it, never while workers are timed: every request of a
            # run names the same modules, and only the first imports them.
            preload = _WORKER_PRELOAD + model_preload(job["config"], job["archive_dir"])
            proc: subprocess.Popen | forkserver_client.ForkedProcess | None = forkserver_client.spawn(
                ["-m", "packrat.profile.worker", jf.name, str(_RESULT_FD)], env,
                fds={0: devnull.fileno(), 1: log.fileno(), 2: log.fileno(), _RESULT_FD: write_fd},
                preload=preload)
            if proc is None:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "packrat.profile.worker", jf.name, str(write_fd)],
                    pass_fds=(write_fd,),
                    env=env,
                    stdin=devnull,
                    stdout=log,
                    stderr=log,
                )
            os.close(write_fd)
            try:
                with os.fdopen(read_fd) as results:
                    for line in results:
                        event = json.loads(line)
                        if event["event"] == "error":
                            error = event["message"]
                        else:
                            on_event(event)
                rc = proc.wait()
            except BaseException:
                proc.kill()  # our own child, by its handle
                proc.wait()
                raise
    finally:  # also when Ctrl-C lands while the fork server is still importing
        Path(jf.name).unlink(missing_ok=True)
    if rc != 0 or error:
        raise ProfileError(
            f"profiling worker for {job['threads']} thread(s) failed: "
            f"{error or f'exit status {rc}'} (log: {log_path})"
        )


def run_profile(
    archive: ArchiveRef,
    settings: ProfileSettings,
    progress: bool = True,
    on_update: Callable[[Profile], None] | None = None,
    log_path: str | Path | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> Profile:
    """Profile `archive` on this machine. `on_update` gets the partial profile after every point;
    `on_event` every worker event as it arrives ({"event": "ready" | "start" | "point" |
    "omitted", "threads": t, ...}): "ready" means the mode loaded and passed its accuracy guard.
    The workers' output is appended to `log_path`; without one it goes to a new temporary file
    that is removed when the run succeeds and kept (the ProfileError names it) when it fails."""
    cores = list(usable_cores().cores)  # affinity ∩ cgroup cpuset, quota cap, $PACKRAT_CORES
    settings.validate(len(cores))
    if log_path:
        log, scratch = Path(log_path), False
        log.parent.mkdir(parents=True, exist_ok=True)
    else:
        fd, name = tempfile.mkstemp(prefix=f"packrat-profile-{os.getpid()}-", suffix=".log")
        os.close(fd)
        log, scratch = Path(name), True
    run = _Run(archive, settings, cores, log, on_update, on_event)
    bar = _Progress(len(run.pending) + len(run.corun_pending), progress,
                    desc=f"profile {archive.model_name} ({settings.scope})")
    try:
        for t in range(1, settings.cores + 1):
            run.isolated(t, bar)
        for k in range(len(run.shapes)):
            run.corun_shape(k, bar)
    finally:
        bar.close()
    if scratch:  # a success's output is not kept where no one asked for it
        log.unlink(missing_ok=True)
    return run.snapshot(complete=True)


class _Run:
    """One profiling run: what has been measured, what is left, and the budget's clock."""

    def __init__(self, archive: ArchiveRef, settings: ProfileSettings, cores: list[int], log: Path,
                 on_update: Callable[[Profile], None] | None,
                 on_event: Callable[[dict[str, Any]], None] | None) -> None:
        self.archive, self.settings, self.cores, self.log = archive, settings, cores, log
        self.on_update, self.on_event = on_update, on_event
        self.fingerprint = current_fingerprint(archive.config)
        self.batches = list(settings.batches) if settings.batches else batch_sizes(settings.max_batch)
        self.rule = {
            "rel_ci": settings.rel_ci,
            "confidence": settings.confidence,
            "min_count": settings.min_count,
            "point_budget_s": settings.point_budget_s,
        }
        self.started_wall = time.monotonic()
        self.created = utc_now()
        self.points: list[ProfilePoint] = []
        self.omitted: list[dict[str, Any]] = []
        self.workers: list[dict[str, Any]] = []
        self.pending = {(t, b) for t in range(1, settings.cores + 1) for b in self.batches}
        self.shapes = corun_shapes(settings.cores) if settings.corun else []
        self.corun: list[ProfilePoint] = []
        self.corun_pending = {(i, t, b) for i, t in self.shapes for b in self.batches}
        # The isolated phase ends here when co-run shapes follow (None: no limit).
        self.iso_budget_s = (settings.budget_s * (1 - settings.corun_share) if self.shapes else settings.budget_s) \
            if settings.budget_s is not None else None

    def elapsed(self) -> float:
        return time.monotonic() - self.started_wall

    def snapshot(self, complete: bool) -> Profile:
        left = [] if complete else [
            {"threads": t, "batch": b, "reason": "not measured yet"} for t, b in sorted(self.pending)
        ] + [{"instances": i, "threads": t, "batch": b, "reason": "not measured yet"}
             for i, t, b in sorted(self.corun_pending)]
        settings = self.settings
        points = tuple(sorted(self.points, key=lambda p: (p.threads, p.batch)))
        corun = tuple(sorted(self.corun, key=lambda p: (p.instances, p.threads, p.batch)))
        shared = contention.summary(points, corun)  # which points were time-shared (corrected)
        return Profile(
            model_id=self.archive.model_id,
            points=points,
            fingerprint=self.fingerprint,
            scope=settings.scope,
            corun=corun,
            extra={
                "model_name": self.archive.model_name,
                "created": self.created,
                "complete": complete,
                "settings": {**asdict(settings), "batches": self.batches, "core_ids": self.cores[: settings.cores],
                             "sizes": self.timed_sizes()},
                "duration_s": round(self.elapsed(), 1),
                "workers": list(self.workers),
                "omitted": sorted(self.omitted + left, key=lambda o: (o["threads"], o["batch"])),
                **({"contention": shared} if shared else {}),
            },
        )

    def timed_sizes(self) -> tuple[tuple[str, int], ...]:
        """The request size per kind the points were timed at (the workers' "sizes": those
        asked for, and the task's own sample's as a served worker counts them), the profile's
        settings' "sizes"; those asked for until a point is timed. (): not known (the sample
        of an archive whose task cannot count it; packrat.profile.shape.timed_sizes)."""
        # A batch timed at its own sizes (sizes_by_batch) does not say the label's.
        other = {b for b, _ in self.settings.sizes_by_batch}
        labelled = [p for p in self.points if p.batch not in other]
        if not labelled:
            return tuple(self.settings.sizes)
        return tuple(sorted((labelled[0].meta.get("sizes") or {}).items()))

    def _landed(self, bar: _Progress) -> None:
        bar.step()
        if self.on_update is not None:
            self.on_update(self.snapshot(complete=False))

    def isolated(self, t: int, bar: _Progress) -> None:
        """The t-thread worker alone, within its share of the isolated phase's budget."""
        budget = None
        if self.iso_budget_s is not None:
            budget = budget_share(max(0.0, self.iso_budget_s - self.elapsed()), t, self.settings.cores)

        def on_worker_event(event: dict[str, Any]) -> None:
            self._worker_event(t, event, bar)

        if budget is not None and budget <= 0:
            for b in self.batches:
                on_worker_event({"event": "omitted", "threads": t, "batch": b, "reason": "total budget exhausted"})
            return
        run_worker({**self._job(t), "cores": self.cores[:t], "budget_s": budget}, on_worker_event, self.log)

    def _job(self, t: int) -> dict[str, Any]:
        """A t-thread worker's job, less its cores and budget (an isolated or a co-run one)."""
        return {"archive_dir": str(self.archive.directory), "config": self.archive.config, "threads": t,
                "batches": worker_batches(self.batches, self.settings.plan_batch, t, self.settings.cores),
                "scope": self.settings.scope, "rule": self.rule, "sizes": dict(self.settings.sizes),
                "sizes_by_batch": [[b, dict(sizes)] for b, sizes in self.settings.sizes_by_batch]}

    def _worker_event(self, t: int, event: dict[str, Any], bar: _Progress) -> None:
        if self.on_event is not None:
            self.on_event({**event, "threads": t})
        kind = event["event"]
        if kind == "ready":
            self.workers.append({"threads": t, **{k: v for k, v in event.items() if k != "event"}})
        elif kind == "start":
            left = ""
            if self.settings.budget_s is not None:
                left = f", {max(0.0, self.settings.budget_s - self.elapsed()):.0f}s left"
            bar.at(f"t={t} b={event['batch']}{left}")
        elif kind in ("point", "omitted"):
            self.pending.discard((event["threads"], event["batch"]))
            if kind == "point":
                fields = contention.handled({k: v for k, v in event.items() if k != "event"}, t)
                self.points.append(ProfilePoint(**fields))
            else:
                self.omitted.append({k: event[k] for k in ("threads", "batch", "reason")})
            self._landed(bar)

    def corun_shape(self, k: int, bar: _Progress) -> None:
        """Co-run shape k (i instances of t threads), within its share of what is left."""
        i, t = self.shapes[k]
        budget = None
        if self.settings.budget_s is not None:
            remaining = self.settings.budget_s - self.elapsed()
            # Shared like the isolated phase: in proportion to 1/t over the shapes left.
            weights = [1.0 / tt for _, tt in self.shapes[k:]]
            budget = max(0.0, remaining) * weights[0] / sum(weights)

        def on_corun(b: int, point: ProfilePoint | None, reason: str | None) -> None:
            self.corun_pending.discard((i, t, b))
            if point is not None:
                self.corun.append(point)
            else:
                self.omitted.append({"instances": i, "threads": t, "batch": b, "reason": reason})
            self._landed(bar)

        bar.at(f"co-run {i} x {t} thread(s)")
        if budget is not None and budget <= 0:
            for b in self.batches:
                on_corun(b, None, "total budget exhausted")
            return
        _run_corun(i, t, self.cores, self._job(t), budget, on_corun, self.log)


def corun_shapes(cores: int) -> list[tuple[int, int]]:
    """The uniform shapes <i, t> that fill T cores with at least 2 instances, thinnest first."""
    return [(cores // t, t) for t in range(1, cores // 2 + 1)]


def _run_corun(
    instances: int,
    threads: int,
    cores: list[int],
    base_job: dict[str, Any],
    budget_s: float | None,
    on_point: Callable[[int, ProfilePoint | None, str | None], None],
    log_path: Path,
) -> None:
    """Run `instances` workers of `threads` threads at once on disjoint cores; report, per
    batch, the co-run point (the slowest instance) or why there is none."""
    lock = threading.Lock()
    seen: dict[int, dict[int, dict[str, Any]]] = {}  # batch -> instance -> point fields
    gaps: dict[int, str] = {}  # batch -> why some instance has no point
    errors: list[BaseException] = []
    blocks = [cores[k * threads:(k + 1) * threads] for k in range(instances)]

    def events(k: int) -> Callable[[dict[str, Any]], None]:
        def on(event: dict[str, Any]) -> None:
            with lock:
                if event["event"] == "point":  # its figures time-shared or not (contention)
                    seen.setdefault(event["batch"], {})[k] = contention.handled(event, threads)
                elif event["event"] == "omitted":
                    gaps.setdefault(event["batch"], f"instance {k}: {event['reason']}")
        return on

    def run(k: int) -> None:
        try:
            run_worker({**base_job, "cores": blocks[k], "budget_s": budget_s}, events(k), log_path)
        except BaseException as exc:  # noqa: BLE001 - reported below, after every instance stopped
            with lock:
                errors.append(exc)

    workers = [threading.Thread(target=run, args=(k,), name=f"corun-{k}", daemon=True)
               for k in range(instances)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for b in base_job["batches"]:
        per = seen.get(b, {})
        if len(per) < instances:
            why = gaps.get(b) or (f"an instance failed: {errors[0]}" if errors else "not every instance measured it")
            on_point(b, None, why[:500])
            continue
        rows = [per[k] for k in range(instances)]

        def worst(key: str) -> float | None:
            vals = [r.get(key) for r in rows]
            return None if any(v is None for v in vals) else max(vals)

        on_point(b, ProfilePoint(
            threads=threads, batch=b, mean_ms=max(r["mean_ms"] for r in rows),
            p50_ms=worst("p50_ms"), p99_ms=worst("p99_ms"), std_ms=worst("std_ms"),
            count=min((r.get("count") or 0) for r in rows) or None, instances=instances,
            meta={"per_instance_mean_ms": [r["mean_ms"] for r in rows], "cores": blocks,
                  # what each worker read from the kernel about its own affinity
                  "per_instance_cpus": [(r.get("meta") or {}).get("cpus_allowed_list") for r in rows],
                  "per_instance_cpu_share": [(r.get("meta") or {}).get("cpu_share") for r in rows],
                  "per_instance_runq_share": [(r.get("meta") or {}).get("runq_share") for r in rows],
                  **({"contention": shared} if (shared := contention.corun_contention(rows)) else {})},
        ), None)



def _starved(meta: dict[str, Any]) -> bool:
    """Whether a point waited for its cores while other processes had them: its threads'
    run-queue wait where the worker recorded it (a low cpu_share is no sign of it then:
    threads idle by nature, packrat.profile.contention), else a CPU share below 0.8."""
    others = meta.get("others_share")
    if others is not None and others < contention.OTHERS_AT:
        return False  # its cores ran nothing else: it waited on its own threads, if at all
    waits = [w for w in (meta.get("runq_share"), meta.get("runq_share_all")) if w is not None]
    return max(waits) >= contention.TIME_SHARED_AT if waits else meta.get("cpu_share", 1.0) < 0.8


def contention_warning(profile: Profile, cores: int | None = None) -> str | None:
    """A one-line warning when points ran on a busy machine, else None.

    Judged from what each worker recorded: the 1-minute load average around the
    point (above the usable cores means others wanted our CPUs) and its threads'
    run-queue wait (_starved; the CPU share for points recorded without it). Such a
    profile is kept (it is what was measured) but flagged.
    """
    cores = cores or (profile.fingerprint.usable_cores if profile.fingerprint else os.cpu_count() or 1)
    busy = [p for p in profile.points if max(p.meta.get("loadavg_1m", [0.0])) > cores or _starved(p.meta)]
    if not busy:
        return None
    load = max(max(p.meta.get("loadavg_1m", [0.0])) for p in busy)
    share = min(p.meta.get("cpu_share", 1.0) for p in busy)
    fixed = sum(1 for p in busy if contention.state(p) == "corrected")
    return (
        f"warning: {len(busy)} of {len(profile.points)} points ran on a busy machine "
        f"(load average up to {load:.1f} on {cores} cores, CPU share down to {share:.2f}); "
        + (f"{fixed} one-thread point(s) were corrected to the time they computed "
           "(packrat.profile.contention), the others' latencies are inflated; " if fixed else
           "their latencies are inflated, ")
        + "re-profile when the machine is quiet"
    )
