"""Tune one model: probe -> for each candidate mode: guard, profile -> choose (mode, plan).

    tune_model(base_dir, model, state_dir, settings, tracker) -> TuneResult

1. probe       which modes this machine and the archive's handler support
               (packrat.profile.probe; packrat.tune.modes picks the candidates).
2. per mode    a profile still valid for this archive and machine is reused
               (packrat.profile.library checks hash and fingerprint; a tune
               asked for some modes also compares the other modes an earlier
               tune measured, where still valid: _measured_before); a mode
               refused earlier for the same archive and machine is not retried
               unless asked for by name; otherwise the mode is profiled in the
               profiler's isolated pinned workers, which load it through the
               archive's own handler. Its accuracy guard runs in the first
               worker before any point is timed ("guarding"): a refused mode
               raises there, is recorded with its reason and gets no profile,
               so nothing can plan from it or serve it. Then the points are
               timed within the mode's share of the budget ("profiling").
               The archive's own mode is measured last (it already serves and
               is usually the slowest), so a short budget cuts it first. A mode
               whose build took half its share or more and left no point, none
               that plans at batch B, or only fat's at B (nothing to compare it
               with), is measured once more at the end (retry_after_cold_build).
               Where no mode but the archive's own was measured (every int8 mode
               refused, no native bf16), the fp32 counterparts of the refused bf16
               graph modes are measured before it (tune.modes.fallback_modes).
3. choose      packrat.plan.plans_per_mode over the modes' profiles for batch
               B: the first mode, the archive's own listed first, whose
               predicted latency is within MODE_MARGIN (3 %) of the fastest
               (a later mode must be more than that faster to be chosen).
               The record's "busy" names the modes whose several-thread points
               were timed while other work had the cores (busy_modes); the
               auto-tuner measures those again once the machine is quiet.

Applying the choice is the controller's (it owns the swap). Every step is
reported to a Tracker, which the REST status shows and which is persisted to
<state dir>/tune/<model>.json, so a restarted controller knows what was
tuned, for which archive and machine (the `key`), and what was refused.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from packrat.errors import ConfigError, PlanError, ProfileError, is_mode_refusal
from packrat.modes import PRECISIONS, RUNTIMES, ExecutionMode, library_versions
from packrat.plan import MODE_MARGIN, ModePlan, fastest, plans_per_mode, realizable_plan, uniform_candidates
from packrat.plan.confidence import is_fat
from packrat.profile import ArchiveRef, ProfileSettings, open_archive, run_profile, save_profile
from packrat.profile.fingerprint import config_in_mode, current_fingerprint
from packrat.profile.identity import archive_in_mode
from packrat.profile.library import HASHES, check_mode_profile, profile_file, profiles_dir
from packrat.profile.probe import PROBED_LIBRARIES, Capabilities, probe_archive
from packrat.profile.shape import shifted, timed_sizes
from packrat.tune.modes import ALL, candidate_modes, fallback_modes
from packrat.types import Plan, Profile, TunePlanRow, TuneRecord, ms_text

DEFAULT_BATCH = 8  # planned for when no load has been observed yet
# One model, every mode: guards, loads and points. 3 modes x ~60 s (2 loads, 8 points
# of <= 5 s) for a full-size model; 4 demo models x 3 min + swaps fit in 15 min on 2 cores.
DEFAULT_BUDGET_S = 180.0
DEFAULT_MAX_BATCH = 8
DEFAULT_POINT_BUDGET_S = 5.0
# A mode is not started with less budget left than this (loading alone takes seconds).
MIN_MODE_BUDGET_S = 8.0
TUNE_DIR = "tune"

log = logging.getLogger("packrat.tune")


@dataclass(frozen=True)
class TuneSettings:
    cores: int
    batch: int = DEFAULT_BATCH
    modes: tuple[str, ...] | None = None  # None: the short list; ("all",): every supported mode
    budget_s: float = DEFAULT_BUDGET_S
    max_batch: int | None = None  # largest profiled batch; None: max(batch, DEFAULT_MAX_BATCH)
    point_budget_s: float = DEFAULT_POINT_BUDGET_S
    fresh: bool = False  # re-profile modes whose profile is still valid
    # The traffic's request sizes to profile at ((kind, size): packrat.profile.shape); (): the
    # task's sample. A saved profile timed at sizes these moved away from (or at sizes it did
    # not record) is measured again; the record keeps the sizes the choice was timed at.
    sizes: tuple[tuple[str, int], ...] = ()
    # The batches profiled at other sizes than `sizes`, the traffic's for each
    # (packrat.profile.runner.ProfileSettings.sizes_by_batch); (): every batch at `sizes`.
    sizes_by_batch: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = ()
    # Modes whose saved profile is measured again although it is valid: those a tune timed on
    # a busy machine (busy_modes), measured again by the auto-tuner once it is quiet.
    remeasure: tuple[str, ...] = ()

    @property
    def profile_max_batch(self) -> int:
        return self.max_batch or max(self.batch, DEFAULT_MAX_BATCH)

    def validate(self, usable_cores: int) -> None:
        if self.batch < 1:
            raise ConfigError(f"batch must be >= 1, got {self.batch}")
        if self.budget_s <= 0:
            raise ConfigError(f"budget must be > 0 s, got {self.budget_s}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.point_budget_s <= 0:
            raise ConfigError(f"point budget must be > 0 s, got {self.point_budget_s}")
        if not 1 <= self.cores <= usable_cores:
            raise ConfigError(f"cores must be 1..{usable_cores}, got {self.cores}")
        for m in self.modes or ():
            if m.strip().lower() != ALL and not _known_mode(m):
                raise ConfigError(f"unknown mode {m!r}: <precision>-<runtime> with precision in "
                                  f"{', '.join(PRECISIONS)} and runtime in {', '.join(RUNTIMES)}, or 'all'")


def _known_mode(text: str) -> bool:
    try:
        return ExecutionMode.parse(text).unknown() is None
    except ValueError:
        return False


def tune_batches(batch: int, cores: int, max_batch: int) -> tuple[int, ...]:
    """Batch sizes to profile, in order: first the caps a realisable plan for `batch`
    on `cores` cores can use (ceil(B/n) for n workers), then 1, 2, 4, ... max_batch.
    Loading a mode can take most of a mode's budget on a busy machine; what is left
    then goes to the points the choice at B needs."""
    from packrat.profile.runner import batch_sizes

    needed = sorted({-(-batch // n) for n in range(1, cores + 1)})
    return tuple(needed + [b for b in batch_sizes(max_batch) if b not in needed])


def record_path(state_dir: str | Path, model: str) -> Path:
    return Path(state_dir) / TUNE_DIR / f"{model}.json"


def load_record(state_dir: str | Path, model: str) -> TuneRecord | None:
    """The model's last tune record; None when there is none or it is unreadable (logged)."""
    path = record_path(state_dir, model)
    try:
        return TuneRecord.from_dict(json.loads(path.read_text()))
    except OSError:
        return None
    except ValueError as exc:  # torn JSON or a malformed record: as if never tuned
        log.warning("tune record %s unusable: %s", path, exc)
        return None


def machine_key(config: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint fields that do not depend on the mode."""
    fp = asdict(current_fingerprint(config))
    fp.pop("mode")
    return fp


def tune_key(base_dir: str | Path, base: str) -> dict[str, Any]:
    """What a tune result is valid for: the base archive (name, content hash) and this machine.
    When it changes, the model is re-tuned (a new archive version, another CPU, torch, ...)."""
    from packrat.profile.library import base_config

    return {"base": base, "model_id": HASHES(base_dir), "machine": machine_key(base_config(base_dir))}


class Tracker:
    """The tune of one model as it goes (a TuneRecord); thread-safe snapshots, persisted on
    every change. set() and mode() take fields in their wire form (TuneRecord.to_dict's)."""

    def __init__(self, state_dir: str | Path | None, model: str,
                 on_change: Callable[[dict[str, Any]], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._path = record_path(state_dir, model) if state_dir is not None else None
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._rec = TuneRecord.from_dict({
            "model": model, "state": "queued", "stage": "queued", "text": "queued",
            "trigger": None, "created": clock(), "started": None, "finished": None,
            "batch": None, "budget_s": None, "candidates": [], "modes": {},
            "skipped": {}, "choice": None, "swap": None, "error": None, "key": None,
        })

    def set(self, **fields: Any) -> None:
        with self._lock:
            self._rec = self._rec.updated(**fields)
            snap = self._rec.to_dict()
        self._publish(snap)

    def mode(self, mode: str, **fields: Any) -> None:
        with self._lock:
            self._rec = self._rec.with_mode(mode, **fields)
            snap = self._rec.to_dict()
        self._publish(snap)

    def now(self) -> float:
        return self._clock()

    def record(self) -> TuneRecord:
        with self._lock:
            return self._rec

    def snapshot(self) -> dict[str, Any]:
        """The record in its wire form (a fresh dict: the caller may keep it)."""
        return self.record().to_dict()

    def _publish(self, snap: dict[str, Any]) -> None:
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._path.with_name(f".{self._path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(snap, indent=1, default=str))
            os.replace(tmp, self._path)
        if self._on_change is not None:
            self._on_change(snap)


@dataclass(frozen=True)
class TuneResult:
    plan: Plan  # carries its mode
    profiles: tuple[Profile, ...]  # the usable profile of every mode that has one
    per_mode: tuple[TunePlanRow, ...]  # each mode's best plan or why it has none


def _shape_text(plan: Plan) -> str:
    groups: dict[tuple[int, int], int] = {}
    for i in plan.instances:
        groups[(i.threads, i.batch)] = groups.get((i.threads, i.batch), 0) + 1
    return " + ".join(f"{n}x(t{t},b{b})" for (t, b), n in groups.items())


def describe(plan: Plan) -> str:
    return f"{plan.mode or 'base mode'} {_shape_text(plan)}"


def _refused_before(previous: TuneRecord | None, mode: str, model_id: str,
                    fingerprint: dict[str, Any]) -> str | None:
    m = previous.modes.get(mode) if previous is not None else None
    if m is not None and m.state == "refused" and m.model_id == model_id and m.fingerprint == fingerprint:
        return m.reason
    return None


def retry_after_cold_build(first_turn: bool, built_s: list[float], share: float) -> bool:
    """A mode that measured nothing to choose a plan with on its first turn (no point, none
    that makes a plan at the tune's batch, or only fat's: judged_at) is given one more
    turn (the tune's last, from the same budget) when its worker got ready and building
    the mode took at least half of its share: the build is in the build cache then, and
    the next load is quick."""
    return first_turn and bool(built_s) and built_s[0] >= 0.5 * share


def plans_at(profile: Profile, cores: int, batch: int) -> bool:
    """Whether the profile has a realisable plan for `batch` on `cores` (what the choice needs)."""
    if not profile.points:
        return False
    try:
        realizable_plan(profile, cores, batch)
    except (PlanError, ProfileError):
        return False
    return True


def judged_at(profile: Profile, cores: int, batch: int) -> bool:
    """Whether some realisable shape other than fat's was measured at `batch`. A mode
    whose cold build left only fat's point (BERT-base int8s-openvino in `make run` run
    10: fat 189 ms, so planned fat; run 9's second turn measured its thin plan at
    153 ms) would otherwise be chosen or dropped unjudged."""
    return any(not is_fat(p) for p in uniform_candidates(profile, cores, batch))


@dataclass(frozen=True)
class _Run:
    """One tune's fixed inputs and its clock (what every step below reads)."""

    archive: ArchiveRef
    model: str
    state_dir: Path
    settings: TuneSettings
    tracker: Tracker
    log_dir: Path
    started: float  # time.monotonic() at the start

    def left(self) -> float:
        return max(0.0, self.settings.budget_s - (time.monotonic() - self.started))

    def fingerprint(self, mode: str) -> dict[str, Any]:
        return asdict(current_fingerprint(config_in_mode(self.archive.config, mode)))


def capabilities_for(record: TuneRecord | None, key: dict[str, Any] | None, base_dir: str | Path
                     ) -> tuple[Capabilities, bool]:
    """(what this machine runs for the archive, whether it is the last tune's answer): the
    last tune's probe when that tune was made for this archive and machine (`key`: tune_key)
    and the probed libraries are installed at the same versions, else a fresh probe (a
    child interpreter importing torch and the runtimes: seconds)."""
    caps = record.capabilities if record is not None and key is not None and record.key == key else None
    if caps and "mode" in caps and caps.get("libraries") == library_versions(PROBED_LIBRARIES):
        return Capabilities.from_dict(caps), True
    return probe_archive(base_dir), False


def tune_model(
    base_dir: str | Path,
    model: str,
    state_dir: str | Path,
    settings: TuneSettings,
    tracker: Tracker,
    *,
    previous: TuneRecord | None = None,
    key: dict[str, Any] | None = None,
    log_dir: str | Path | None = None,
) -> TuneResult:
    """Guard and profile every candidate mode of `model`'s base archive, then choose; see the
    module doc. `key` (tune_key) lets it reuse `previous`'s probe when both were made for it."""
    started = time.monotonic()
    tracker.set(state="running", stage="probing", text="probing what this machine can run",
                started=tracker.now(), batch=settings.batch, budget_s=settings.budget_s)
    archive = open_archive(base_dir)
    caps, reused = capabilities_for(previous, key, archive.directory)
    if reused:
        log.info("%s: the last tune's probe reused (same archive, machine and libraries)", model)
    tracker.set(probe="the last tune's, reused (same archive, machine and libraries)" if reused else "probed")
    requested = [m.strip().lower() for m in settings.modes or ()]
    modes, skipped = candidate_modes(caps, requested or None)
    tracker.set(candidates=modes, skipped=skipped, capabilities=caps.to_dict(),
                model_id=archive.model_id)
    log_dir = Path(log_dir) if log_dir else Path(state_dir) / TUNE_DIR
    log_dir.mkdir(parents=True, exist_ok=True)
    run = _Run(archive, model, Path(state_dir), settings, tracker, log_dir, started)
    todo, profiles = _settle(run, modes, requested, previous)
    if requested and not settings.fresh:
        # Asked to try some modes: the modes an earlier tune measured, whose profiles are still
        # valid here, are compared too (appended: the archive's own stays first). Trying one
        # more mode must not drop a faster one found before.
        earlier = _measured_before(run, modes)
        for mode, prof in earlier.items():
            tracker.mode(mode, state="reused", path=str(profile_file(run.state_dir, model, mode)),
                         points=len(prof.points), note="measured by an earlier tune, still valid: compared too")
        profiles.update(earlier)
        modes.extend(earlier)
        tracker.set(candidates=modes)
    spare = [] if requested else fallback_modes(caps, modes, skipped)

    def fallback() -> list[str]:
        # Nothing but the archive's own mode could be measured: its graph runtimes in fp32.
        tracker.set(candidates=[*modes, *spare], fallback=spare)
        modes.extend(spare)
        more, reused = _settle(run, spare, requested, previous)
        profiles.update(reused)
        return more

    _measure(run, todo, caps.mode, profiles, fallback if spare else None)
    result = _choose(run, modes, profiles)
    # The sizes the choice's figures were timed at: the traffic's asked for, the task's own
    # sample's for the other kinds (the chosen mode's profile); why_retune compares them.
    # "busy": the modes whose figures were timed while other work had the cores
    # (packrat.control.tuning.why_busy measures them again once the machine is quiet).
    busy = busy_modes({m: profiles[m] for m in modes if m in profiles})
    tracker.set(sizes={**timed_sizes(profiles[result.plan.mode]), **dict(settings.sizes)},
                **({"busy": busy} if busy else {}))
    return result


# The reasons a mode's record gives when the tune's budget cut it short; out_of_budget
# recognises them (the auto-tuner tunes such a failure again once the machine is quiet).
BUDGET_SKIPPED = "tuning budget exhausted"
BUDGET_NOTHING_MEASURED = "no point measured within its budget"


def out_of_budget(record: TuneRecord) -> list[str]:
    """The modes of a tune that the budget cut short: skipped with it exhausted, or nothing
    measured within their share."""
    return [m for m, r in record.modes.items()
            if (r.state == "skipped" and (r.reason or "").startswith(BUDGET_SKIPPED))
            or (r.state == "failed" and r.reason == BUDGET_NOTHING_MEASURED)]


def busy_modes(profiles: dict[str, Profile]) -> dict[str, list[list[int]]]:
    """{mode: its contended points as [instances, threads, batch]} for the profiles that have
    any: several-thread points that got less CPU than they ask while other work had their
    cores (packrat.profile.contention). Their figures are inflated and not corrected, so a
    choice made from them may not be the fastest on a quiet machine. One-thread points that
    were time-shared are corrected there and do not count."""
    out: dict[str, list[list[int]]] = {}
    for mode, prof in profiles.items():
        found = (prof.extra.get("contention") or {}).get("contended") or []
        if found:
            out[mode] = [list(p) for p in found]
    return out


def _settle(run: _Run, modes: list[str], requested: list[str], previous: TuneRecord | None
            ) -> tuple[list[str], dict[str, Profile]]:
    """(modes that need measuring, {mode: its reused profile}); the rest refused before."""
    todo: list[str] = []
    profiles: dict[str, Profile] = {}
    settings, archive, tracker = run.settings, run.archive, run.tracker
    for mode in modes:
        path = profile_file(run.state_dir, run.model, mode)
        # Points a run's budget omitted stay omitted until a fresh tune: a reused profile
        # needs only to be valid (hash, fingerprint, complete), to reach the batch sizes and
        # to have points at every thread count the plan may give a worker (1..cores).
        chk = check_mode_profile(path, mode, archive.model_id, archive.config, cores=settings.cores)
        fp = run.fingerprint(mode)
        prof_max = (chk.profile.extra.get("settings") or {}).get("max_batch", 0) if chk.profile else 0
        refused = _refused_before(previous, mode, archive.model_id, fp)
        moved = _sizes_moved(chk.profile, settings.sizes)
        again = mode in settings.remeasure
        if (chk.usable and not settings.fresh and prof_max >= settings.profile_max_batch and not moved
                and not again):
            assert chk.profile is not None
            profiles[mode] = chk.profile
            tracker.mode(mode, state="reused", path=str(path), points=len(chk.profile.points))
        elif refused and mode not in requested and not settings.fresh:
            tracker.mode(mode, state="refused", reason=refused, model_id=archive.model_id,
                         fingerprint=fp, note="refused earlier for this archive and machine")
        else:
            why = ("fresh requested" if chk.usable and settings.fresh
                   else "its profile was timed on a busy machine: measured again now that it is quiet"
                   if chk.usable and again
                   else f"traffic's input shape moved ({', '.join(moved)})" if chk.usable and moved
                   else f"profiled up to batch {prof_max}, {settings.profile_max_batch} wanted" if chk.usable
                   else "; ".join(chk.problems))
            tracker.mode(mode, state="pending", path=str(path), why=why)
            todo.append(mode)
    return todo, profiles


def _measured_before(run: _Run, modes: list[str]) -> dict[str, Profile]:
    """{mode: its saved profile} for the modes not in `modes` whose profile in the state
    directory is still valid for this archive and machine, reaches the tune's batches and
    thread counts and was timed at the traffic's sizes (what _settle would reuse)."""
    found: dict[str, Profile] = {}
    settings = run.settings
    for path in sorted(profiles_dir(run.state_dir, run.model).glob("*.json")):
        mode = path.stem
        if mode in modes or not _known_mode(mode):
            continue
        chk = check_mode_profile(path, mode, run.archive.model_id, run.archive.config, cores=settings.cores)
        if not chk.usable or chk.profile is None:
            continue
        prof_max = (chk.profile.extra.get("settings") or {}).get("max_batch", 0)
        if prof_max >= settings.profile_max_batch and not _sizes_moved(chk.profile, settings.sizes):
            found[mode] = chk.profile
    return found


def _sizes_moved(profile: Profile | None, sizes: tuple[tuple[str, int], ...]) -> list[str]:
    """The kinds of `sizes` (the traffic's) that the sizes the profile was timed at (the
    traffic's it was asked for, or the task's own sample's: timed_sizes) are far from
    (packrat.profile.shape.shifted). None without traffic sizes. A profile whose sizes are
    not known (made before profiles recorded their sample's) counts as moved: measured
    again at the traffic's sizes, which the new profile then records."""
    if not sizes:
        return []
    return shifted(timed_sizes(profile), dict(sizes))


def _measure(run: _Run, todo: list[str], own_mode: str, profiles: dict[str, Profile],
             fallback: Callable[[], list[str]] | None = None) -> None:
    """Guard and profile each mode of `todo` within its share of the budget left; adds
    what was measured to `profiles`. `fallback`: called once, when only the archive's own
    mode is left to measure (or all is done) and no other mode has a profile, for more modes
    to measure before it (packrat.tune.modes.fallback_modes)."""
    # The archive's own mode is measured last: it already serves, and it is usually the
    # slowest (its large batches cost the most), so a budget that runs short cuts it first.
    todo.sort(key=lambda m: m == own_mode)
    k = 0
    while k < len(todo) or fallback is not None:  # a retried mode is appended: the loop reaches it
        # Decided before the own mode's turn, or at the end while another mode's retry is due.
        if fallback is not None and (k == len(todo) or (
                todo[k] == own_mode and all(m == own_mode for m in todo[k:]))):
            if not set(profiles) - {own_mode}:
                todo[k:k] = fallback()
            fallback = None
            continue
        mode = todo[k]
        k += 1
        remaining = run.left()
        share = remaining / (len(todo) - k + 1)
        if share < MIN_MODE_BUDGET_S:
            run.tracker.mode(mode, state="skipped",
                             reason=f"{BUDGET_SKIPPED} ({remaining:.0f} s left)")
            continue
        first_turn = mode not in todo[:k - 1]
        # A retried mode counts again in N; say so, or "mode 4 of 4" reads as a fourth mode.
        label = f"mode {k} of {len(todo)} to measure" + ("" if first_turn else ": its second turn, built now")
        prof, retry = _turn(run, mode, label, share, first_turn=first_turn)
        # Kept even without a plan at B: a retry that measures less does not lose it.
        if prof is not None and prof.points:
            profiles[mode] = prof
        if retry:
            todo.append(mode)


class _Progress:
    """The profiler's events for one mode, reported to the tracker: guarded once the
    first worker is ready (its guard passed), then points as they are measured."""

    def __init__(self, run: _Run, mode: str, label: str) -> None:
        self.run, self.mode, self.label = run, mode, label
        self.guarded = threading.Event()
        self.built_s: list[float] = []

    def on_event(self, ev: dict[str, Any]) -> None:
        if ev.get("event") == "ready" and not self.guarded.is_set():
            self.guarded.set()
            summary = ev.get("mode") or {}
            self.built_s.append(float(summary.get("build_s") or 0.0))
            self.run.tracker.mode(self.mode, state="profiling", guard=summary.get("guard"),
                                  build_s=summary.get("build_s"))
            self.run.tracker.set(stage="profiling",
                                 text=f"profiling {self.mode} ({self.label}), {self.run.left():.0f} s left")

    def on_update(self, partial: Profile) -> None:
        omitted = partial.extra.get("omitted", [])
        total = len(partial.points) + len(omitted)
        done = total - sum(1 for o in omitted if o.get("reason") == "not measured yet")
        self.run.tracker.mode(self.mode, points_done=done, points_total=total)
        self.run.tracker.set(stage="profiling", points_done=done, points_total=total,
                             text=f"profiling {self.mode} ({self.label}): {done} of {total} points, "
                                  f"{self.run.left():.0f} s left")


def _turn(run: _Run, mode: str, label: str, share: float, first_turn: bool) -> tuple[Profile | None, bool]:
    """One mode's guard and profile within `share` seconds: (its profile or None, whether
    to measure it once more at the end: retry_after_cold_build)."""
    settings, tracker = run.settings, run.tracker
    fp = run.fingerprint(mode)
    tracker.mode(mode, state="guarding", budget_s=round(share, 1))
    what = ("loading it (the guard's reference)" if mode == "fp32-eager"
            else "loading it and comparing it with fp32 eager")
    tracker.set(stage="guarding", mode=mode,
                text=f"guarding {mode} ({label}): {what}, {run.left():.0f} s left")
    m_started = time.monotonic()
    progress = _Progress(run, mode, label)
    psettings = ProfileSettings(
        cores=settings.cores, max_batch=settings.profile_max_batch, budget_s=share,
        point_budget_s=settings.point_budget_s,
        batches=tune_batches(settings.batch, settings.cores, settings.profile_max_batch),
        plan_batch=settings.batch, sizes=settings.sizes, sizes_by_batch=settings.sizes_by_batch)
    try:
        prof = run_profile(archive_in_mode(run.archive, mode), psettings, progress=False,
                           on_update=progress.on_update, on_event=progress.on_event,
                           log_path=run.log_dir / f"{run.model}-{mode}.log")
    except ProfileError as exc:
        msg = str(exc)
        state = "refused" if (is_mode_refusal(msg) and not progress.guarded.is_set()) else "failed"
        tracker.mode(mode, state=state, reason=msg[:2000], model_id=run.archive.model_id, fingerprint=fp,
                     duration_s=round(time.monotonic() - m_started, 1))
        return None, False
    path = profile_file(run.state_dir, run.model, mode)
    if prof.points:
        save_profile(prof, path)
    has_plan = plans_at(prof, settings.cores, settings.batch)
    if (retry_after_cold_build(first_turn, progress.built_s, share)
            and not (has_plan and judged_at(prof, settings.cores, settings.batch))):
        # Building the mode (int8-static calibration, say) took most of its share; the
        # build is cached now, so a later turn loads it in seconds and measures.
        tracker.mode(mode, state="pending", why=(
            f"building it took {progress.built_s[0]:.0f} s of its {share:.0f} s share and left "
            f"{len(prof.points)} point(s), {'only fat' if has_plan else 'no plan'} at batch "
            f"{settings.batch}; measured again from the build cache after the other modes, "
            "within the same budget"))
        return prof, True
    if not prof.points:
        tracker.mode(mode, state="failed", reason=BUDGET_NOTHING_MEASURED,
                     duration_s=round(time.monotonic() - m_started, 1))
        return prof, False
    tracker.mode(mode, state="profiled", path=str(path), points=len(prof.points),
                 omitted=len(prof.extra.get("omitted", [])),
                 duration_s=round(time.monotonic() - m_started, 1))
    return prof, False


def _plan_row(mp: ModePlan, best: ModePlan | None, quickest: ModePlan | None) -> TunePlanRow:
    """One mode's line of the choice: its best plan, or why it has none."""
    if mp.plan is None:
        return TunePlanRow(mp.mode, reason=mp.reason)
    kept = None
    if mp is best and quickest is not best:
        kept = (f"chosen before {quickest.mode} ({ms_text(quickest.plan.predicted_latency_ms, '.0f')} ms): "
                f"a later mode must be more than {MODE_MARGIN:.0%} faster")
    return TunePlanRow(mp.mode, predicted_ms=round(mp.plan.predicted_latency_ms, 3),
                       fat_ms=None if mp.plan.fat_latency_ms is None else round(mp.plan.fat_latency_ms, 3),
                       shape=_shape_text(mp.plan), kept=kept)


def _choose(run: _Run, modes: list[str], profiles: dict[str, Profile]) -> TuneResult:
    """The (mode, plan) for the tune's batch among the measured modes (plans_per_mode)."""
    settings, tracker = run.settings, run.tracker
    tracker.set(stage="planning", mode=None, text=f"planning: best (mode, plan) for B={settings.batch}")
    ordered = [profiles[m] for m in modes if m in profiles]
    if not ordered:
        raise ProfileError(f"no mode of {run.model} could be profiled: "
                           + "; ".join(f"{m}: {v.state} {v.reason or ''}"
                                       for m, v in tracker.record().modes.items()))
    per_mode, best = plans_per_mode(ordered, settings.cores, settings.batch, realizable=True)
    quickest = fastest(per_mode)
    report = []
    for mp in per_mode:
        row = _plan_row(mp, best, quickest)
        tracker.mode(mp.mode, plan=row.to_dict())
        report.append(row)
    if best is None or best.plan is None:
        raise PlanError(f"no mode of {run.model} has a plan for B={settings.batch}: "
                        + "; ".join(f"{r.mode}: {r.reason}" for r in report))
    plan = replace(best.plan, mode=best.mode)
    return TuneResult(plan=plan, profiles=tuple(ordered), per_mode=tuple(report))


def requested_modes(modes: Sequence[str] | None) -> tuple[str, ...] | None:
    """A request's modes as TuneSettings wants them (None or empty: the defaults)."""
    if not modes:
        return None
    return tuple(m.strip().lower() for m in modes if m.strip()) or None
