"""Tuning orchestration: a tune of one model as a background job, its choice applied by
the usual swap; and tuning on by default (AutoTuner), every Packrat model by itself.

`AutoTuner.check()` runs every `interval_s` on its own thread beside the
controller's tick and starts a tune (Controller.start_tune, queued: one
measures at a time) for each Packrat model whose last tune

  - does not exist                 (a model seen for the first time: `make run`,
                                    or a TorchServe the user started and attached to),
  - was made for another key       (the base archive's content hash changed: a new
                                    archive version registered; or the machine's
                                    fingerprint changed: CPU, cores, allocator, torch),
  - was interrupted                (the controller stopped mid-tune),
  - was timed on a busy machine    (several-thread points contended: its "busy" modes;
                                    measured again, once, when the controller's cores
                                    were quiet for `tune_again_quiet_s`: why_busy),
  - failed for want of budget      (modes skipped or cut short by it: a loaded machine;
                                    tuned again, once, when quiet: why_busy),

unless an operator pinned the model (packrat.control.pins): a pinned model is
not tuned (an explicit tune is refused too), and a tune that was running when
the pin came does not apply its choice.

A tune that failed otherwise is not retried automatically for the same key (it would
fail again in a loop); POST /v1/models/{m}/tune retries it. Models whose
live version is not a Packrat archive are left alone. Every per-mode profile
is also checked against hash and fingerprint wherever it is used
(packrat.profile.library), so between two checks nothing plans from a stale one.

With tuning off (--no-tune), `Reprofiler` still follows the traffic's input
shape: a shift plans from the profile kept for the traffic's shape when one was
measured before, else re-profiles the live mode at the traffic's sizes, and
re-plans from that profile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packrat import tune
from packrat.apply.swap import Swapper
from packrat.control.live import base_of, packrat_base, require_packrat
from packrat.control.quiet import Quiet
from packrat.control.swaps import Swaps
from packrat.control.traffic import plan_batch, profile_shape, why_moved, why_retune, worker_sizes
from packrat.control.values import ModelState
from packrat.errors import BusyError, ConfigError, PackratError
from packrat.jobs import Job, Jobs, Turns
from packrat.plan import same_shape
from packrat.profile import library
from packrat.profile.library import Checked
from packrat.profile.shape import RECENT_S, RecentSizes, representative_sizes, shifted, sizes_by_batch, timed_sizes
from packrat.tune.run import out_of_budget
from packrat.types import Plan, Policy, Profile, TuneRecord, ms_text
from packrat.worker_counters import SizeHistogram

if TYPE_CHECKING:  # the coordinator; it imports this module
    from packrat.control import Controller

log = logging.getLogger("packrat.autotune")


@dataclass(frozen=True)
class TuneOptions:
    """What a tune asks for; None: tune's defaults (packrat.tune.run)."""

    modes: Sequence[str] | None = None
    budget_s: float | None = None
    batch: int | None = None
    fresh: bool = False
    max_batch: int | None = None
    point_budget_s: float | None = None
    remeasure: tuple[str, ...] = ()  # modes measured again although their profile is valid (why_busy)


class Tuning:
    """The tune of each model: started as a job (tunes and profiling take turns), followed by a
    tune.Tracker, its choice applied by a swap once no other swap runs."""

    def __init__(self, state_dir: Path, model_store: Path, swapper: Swapper, cores: Sequence[int], jobs: Jobs,
                 turns: Turns, swaps: Swaps, read_state: Callable[[str], ModelState],
                 clock: Callable[[], float], apply_wait_s: float, policy: Policy | None,
                 pinned: Callable[[str], bool] = lambda model: False) -> None:
        self.state_dir, self.model_store, self.swapper = state_dir, model_store, swapper
        self.cores = tuple(cores)
        self.jobs, self.turns, self.swaps, self.read_state = jobs, turns, swaps, read_state
        self.clock, self.apply_wait_s, self.policy = clock, apply_wait_s, policy
        self.pinned = pinned  # an operator pinned the model: no tune, no tune's choice applied
        self._tunes: dict[str, tune.Tracker] = {}  # model -> the tracker of its latest tune

    def key(self, st: ModelState) -> dict[str, Any] | None:
        """What a tune of the model is valid for (base archive, its hash, this machine);
        None when the live version is not a Packrat archive (nothing to tune)."""
        found = packrat_base(self.swapper, self.model_store, st)
        if found is None:
            return None  # a model served by its own handler: no modes to try
        base, base_dir = found
        return tune.tune_key(base_dir, base)

    def record(self, model: str) -> TuneRecord | None:
        """The running or last tune of `model` (stage, modes, choice), or None if never tuned."""
        tracker = self._tunes.get(model)
        return tracker.record() if tracker is not None else tune.load_record(self.state_dir, model)

    def status(self, model: str) -> dict[str, Any] | None:
        """record() in its wire form (the REST status)."""
        rec = self.record(model)
        return rec.to_dict() if rec is not None else None

    def observed_batch(self, model: str) -> int | None:
        """The re-plan loop's latest ready estimate of B under load, if any."""
        if self.policy is None:
            return None
        for d in reversed(self.policy.last_decisions(model, last=10)):
            if d.estimate.ready and not d.estimate.idle and d.estimated_batch:
                return d.estimated_batch
        return None

    def start(self, st: ModelState, options: TuneOptions, trigger: str = "request") -> Job:
        """Tune the model in the background (see Controller.start_tune)."""
        model = st.model
        base, base_dir = require_packrat(self.swapper, self.model_store, st, "nothing to tune")
        if self.pinned(model):
            raise BusyError(f"{model} is pinned by an operator: unpin it first "
                            f'(PUT /v1/models/{model}/pin {{"pinned": false}})')
        if self.jobs.unfinished("tune", model) is not None:
            raise BusyError(f"a tune of {model} is already queued or running")
        o = options
        settings = tune.TuneSettings(
            cores=len(self.cores), batch=o.batch or self.observed_batch(model) or tune.DEFAULT_BATCH,
            modes=tune.requested_modes(o.modes), budget_s=o.budget_s or tune.DEFAULT_BUDGET_S, fresh=o.fresh,
            max_batch=o.max_batch, point_budget_s=o.point_budget_s or tune.DEFAULT_POINT_BUDGET_S,
            remeasure=tuple(o.remeasure))
        settings.validate(len(self.cores))
        label, by_batch = profile_shape(st, settings.batch, settings.profile_max_batch)  # the traffic's, else ()
        settings = replace(settings, sizes=label, sizes_by_batch=by_batch)
        previous = tune.load_record(self.state_dir, model)
        job_ref: dict[str, Job] = {}

        def publish(snap: dict[str, Any]) -> None:
            job = job_ref.get("job")
            if job is not None:
                job.progress = snap

        tracker = tune.Tracker(self.state_dir, model, on_change=publish)
        tracker.set(trigger=trigger, batch=settings.batch, budget_s=settings.budget_s, sizes=dict(settings.sizes))
        self._tunes[model] = tracker

        def work(job: Job) -> dict[str, Any]:
            job_ref["job"] = job
            key: dict[str, Any] | None = None
            try:
                key = tune.tune_key(base_dir, base)
                result = tune.tune_model(base_dir, model, self.state_dir, settings, tracker, previous=previous,
                                         key=key)
                return self._apply_tuned(model, result, tracker, key)
            except Exception as exc:
                tracker.set(state="failed", stage="failed", text=f"failed: {exc}"[:500], error=str(exc),
                            finished=self.clock(), key=key)
                raise

        job = self.jobs.start("tune", model, work, per_model=True, turns=self.turns, with_job=True)
        job.progress = tracker.snapshot()
        return job

    def _apply_tuned(self, model: str, result: tune.TuneResult, tracker: tune.Tracker,
                     key: dict[str, Any]) -> dict[str, Any]:
        plan = result.plan
        base_row = result.per_mode[0] if result.per_mode else None  # the archive's own mode comes first
        summary = (f"{tune.describe(plan)}: predicted {ms_text(plan.predicted_latency_ms, '.0f')} ms at B={plan.batch}"
                   + (f" (fat {base_row.mode}: {ms_text(base_row.fat_ms, '.0f')} ms)"
                      if base_row is not None and base_row.fat_ms else ""))
        summary += busy_note(tracker.record())
        tracker.set(stage="applying", text=f"applying {summary}", choice=plan.to_dict())
        swap = self.apply_choice(model, plan)
        if swap is None:
            tracker.set(state="done", stage="pinned", text=f"not applied (pinned by an operator): {summary}",
                        swap={"outcome": "not applied: pinned"}, finished=self.clock(), key=key)
            return tracker.snapshot()
        tracker.set(state="done", stage="applied", text=f"applied {summary}", swap=swap,
                    finished=self.clock(), key=key)
        return tracker.snapshot()

    def apply_choice(self, model: str, plan: Plan) -> dict[str, Any] | None:
        """Apply a plan chosen in the background (a tune's, a re-profile's) by the usual swap:
        its wire record, {"outcome": "already live"} when the live plan is it (shape and
        mode), None (nothing applied) when an operator pinned the model meanwhile."""
        live = self.read_state(model)  # read now: the tune or profile took minutes
        live_plan = replace(live.plan, mode=live.plan.mode or live.mode) if live.plan is not None else None
        if live_plan is not None and same_shape(live_plan, plan) and live_plan.mode == plan.mode:
            return {"outcome": "already live", "version": live.version}
        # Another swap (the re-plan loop's, a REST apply) may be running: wait for its end,
        # unless an operator pins the model meanwhile.
        record = self.swaps.apply_when_free(model, plan, self.apply_wait_s, wanted=lambda: not self.pinned(model))
        return record.to_dict() if record is not None else None


def busy_note(record: TuneRecord) -> str:
    """'' or, for a tune that timed contended points, what its final text adds: which modes,
    and, when it was itself the re-measure of a busy tune, how to measure them again."""
    busy = record.detail.get("busy") or {}
    if not busy:
        return ""
    modes = ", ".join(f"{m} ({len(points)} contended point{'s' if len(points) > 1 else ''})"
                      for m, points in busy.items())
    if (record.trigger or "").startswith(f"auto: {BUSY_WHY}"):
        return (f"; timed on a busy machine again: {modes}; `packrat tune {record.model} --fresh` "
                "when it is quiet")
    return f"; timed on a busy machine: {modes}"


def why_tune(record: TuneRecord | None, key: dict[str, Any], running: bool) -> str | None:
    """Why a model with this last tune record needs tuning now (None: it does not). Pure."""
    if running:
        return None
    if record is None:
        return "never tuned"
    if record.key != key:
        old = record.key or {}
        if old.get("base") != key.get("base") or old.get("model_id") != key.get("model_id"):
            return "new archive version" if old else "never finished"
        return "machine fingerprint changed"
    if record.state not in ("done", "failed"):
        return "interrupted"
    return None


BUSY_WHY = "its last tune was timed on a busy machine"
BUDGET_WHY = "its last tune ran out of its budget"


def why_busy(record: TuneRecord | None, quiet_s: float, again_after_s: float) -> tuple[str, tuple[str, ...]] | None:
    """(why, the modes to measure again) once the controller's cores have been quiet for
    `again_after_s` (`quiet_s` so far), for a model whose last tune

      - finished but timed contended points (its "busy" modes: packrat.tune.run.busy_modes):
        those modes are measured again, the others' profiles reused;
      - failed because its budget ran out before any mode had a plan (modes skipped with
        the budget exhausted, or measured nothing within their share: a loaded machine
        stretches loading and building a mode): tuned again as a whole (no modes named).

    None otherwise, with `again_after_s` <= 0 (off), and after a tune that was itself
    such a second try (once: a machine that is busy again by then keeps the second
    outcome, and status says so). Other failures are not retried (why_tune). Pure."""
    if record is None or again_after_s <= 0 or quiet_s < again_after_s:
        return None
    trigger = record.trigger or ""
    if trigger.startswith((f"auto: {BUSY_WHY}", f"auto: {BUDGET_WHY}")):
        return None
    if record.state == "failed":
        short = out_of_budget(record)
        if not short:
            return None
        return f"{BUDGET_WHY} ({', '.join(short)}); tuned again after {quiet_s:.0f} s quiet", ()
    busy = record.detail.get("busy") or {}
    if record.state != "done" or not busy:
        return None
    modes = tuple(busy)
    return f"{BUSY_WHY} ({', '.join(modes)}); measured again after {quiet_s:.0f} s quiet", modes


class AutoTuner:
    def __init__(self, controller: Controller, interval_s: float = 10.0, *,
                 modes: Sequence[str] | None = None, budget_s: float | None = None,
                 batch: int | None = None, max_batch: int | None = None,
                 point_budget_s: float | None = None, again_quiet_s: float = 0.0,
                 quiet: Quiet | None = None) -> None:
        self.controller = controller
        self.interval_s = interval_s
        # A tune timed on a busy machine is measured again after this long quiet (0: never).
        self.again_quiet_s = again_quiet_s
        self.quiet = quiet or Quiet(controller.cores)
        # What every automatic tune asks for (None: Controller.start_tune's defaults).
        self.options = TuneOptions(modes=list(modes) if modes else None, budget_s=budget_s, batch=batch,
                                   max_batch=max_batch, point_budget_s=point_budget_s)
        self.started: list[tuple[str, str]] = []  # (model, why), for logs and tests

    def check(self) -> list[str]:
        """Start a tune for every model that needs one; returns those models."""
        c = self.controller
        out = []
        quiet_s = self.quiet.update() if self.again_quiet_s > 0 else 0.0
        for model in c.models():
            try:
                st = c.model_state(model)  # one reading: the key and the tune use it
                key = c.tuning.key(st)
                if key is None:
                    continue  # not a Packrat archive
                if c.pins.pinned(model):
                    continue  # the operator's (mode, plan) stays
                running = c.jobs.unfinished("tune", model) is not None
                record = None if running else c.tuning.record(model)  # read once: tune/<m>.json
                why = why_tune(record, key, running) or (None if running else why_retune(record, st))
                options = self.options
                if why is None and not running:
                    busy = why_busy(record, quiet_s, self.again_quiet_s)
                    if busy is not None:
                        why, modes = busy
                        options = replace(options, remeasure=modes)
                if why is None:
                    continue
                c.tuning.start(st, options, trigger=f"auto: {why}")
            except BusyError:
                continue
            except PackratError as exc:
                log.warning("auto-tune of %s not started: %s", model, exc)
                continue
            log.info("auto-tune of %s started: %s", model, why)
            self.started.append((model, why))
            out.append(model)
        return out

    def run(self, stop: threading.Event) -> None:
        """Check right away, then every interval_s until `stop` is set; nothing raised ends it."""
        _every(self.interval_s, self.check, stop, "auto-tune")


def _every(interval_s: float, check: Callable[[], Any], stop: threading.Event, what: str) -> None:
    """check() right away, then every interval_s until `stop` is set; nothing raised ends it."""
    while True:
        try:
            check()
        except Exception:
            log.exception("%s check failed; continuing", what)
        if stop.wait(interval_s):
            return


@dataclass(frozen=True)
class Shift:
    """The traffic moved from the shape the model is planned from (Reprofiler.shift)."""

    profile: Profile  # the profile planned from until now
    why: str
    now: dict[str, int]  # the traffic's representative sizes lately (packrat.profile.shape.RecentSizes)
    lately: dict[str, SizeHistogram]  # what it sent lately, whose quantiles a re-profile times each batch at
    kept: Checked | None  # a kept profile of this archive, mode and machine covering `now`, if any


class Reprofiler:
    """With tuning off (--no-tune) the plan still follows the traffic's input shape: when the
    traffic's sizes lately (the last ~RECENT_S: packrat.profile.shape.RecentSizes; a worker's
    own histogram counts since it started and would hide a shift for minutes) moved a factor
    SHIFT_FACTOR from those the profile planned from was timed at, the model is planned
    from a profile of the traffic's shape:

      - one kept from before (packrat.profile.library.kept_covering: the same archive, mode
        and machine, timed sizes within the factor of the traffic's) when the traffic moved
        back to a shape already measured: restored at once, no re-profile, no wait;
      - else a new one: the live mode profiled at the traffic's sizes (Planner.start_profile:
        the profiler's job, no search of modes).

    Either way the profile planned from until then is kept for its shape first
    (library.keep), so every shape is measured once per archive, mode and machine. With a
    re-plan loop (adapt on) the loop re-plans on its next tick, under its own rules (the
    model's cores, dwell, swap bound); without one the re-plan is done here, for the live
    plan's B on as many cores, applied as a tune applies its choice.

    Left alone like the auto-tuner's: pinned models, models that are not Packrat archives,
    and models with no profile to plan from. A profile made at the task's sample before
    there was traffic records the sample's sizes and is compared like any other; one whose
    sizes are not known (made before they were recorded) counts as moved once there is
    traffic. Re-profiles only (a kept profile is never held): one try per shift, a
    re-profile that fails (or again records no sizes: an archive whose task cannot time the
    traffic's) is not retried until the traffic moves again from the sizes it tried, and
    none starts within min_gap_s of the last one for the model (a load batch moving back
    and forth to shapes never measured moves the sizes with it)."""

    def __init__(self, controller: Controller, interval_s: float = 10.0, min_gap_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, window_s: float = RECENT_S) -> None:
        self.controller, self.interval_s, self.min_gap_s, self.clock = controller, interval_s, min_gap_s, clock
        self.recent = RecentSizes(window_s)
        self.tried: dict[str, tuple[float, dict[str, int]]] = {}  # model -> (when, sizes) of its last re-profile
        self.started: list[tuple[str, str]] = []  # (model, why), for logs and tests
        self.reused: list[tuple[str, str, str]] = []  # (model, why, kept profile file), for logs and tests

    def traffic(self, st: ModelState) -> tuple[dict[str, int], dict[str, SizeHistogram]]:
        """The sizes to plan the traffic of lately at the live plan's B ({}: too few requests),
        and the histograms of lately they were read from."""
        recent = self.recent.update(st.model, self.clock(), worker_sizes(st))
        return dict(representative_sizes(recent, plan_batch(st))), recent

    def shift(self, st: ModelState) -> Shift | None:
        """What the traffic moved from and to, and a kept profile covering it; None when
        nothing is to be done now (class doc)."""
        c = self.controller
        now, lately = self.traffic(st)  # read at every check, so "lately" stays ~window_s after a skip too
        if c.tuning.key(st) is None or c.pins.pinned(st.model) or st.mode is None:
            return None
        if c.jobs.unfinished("profile", st.model) is not None or c.jobs.unfinished("tune", st.model) is not None:
            return None
        try:
            profile = c.planner.profile(st)
        except PackratError:
            return None  # nothing planned from yet: a profile or tune request makes one
        made_at = timed_sizes(profile)
        moved = shifted(made_at, now) if now else []
        if not moved:
            return None
        _, base_dir = base_of(c.planner.swapper, c.planner.model_store, st)
        kept = library.kept_covering(c.planner.state_dir, st.model, st.mode, base_dir, now)
        last = self.tried.get(st.model)
        if kept is None and last is not None and (not shifted(last[1], now)
                                                  or self.clock() - last[0] < self.min_gap_s):
            return None  # tried this shape already, or re-profiled a moment ago
        return Shift(profile, why_moved(made_at, now, moved), now, lately, kept)

    def why(self, st: ModelState) -> tuple[Profile, str] | None:
        """(the profile planned from now, why it must be measured again), or None: also when
        a kept profile covers the traffic (check() plans from that one, nothing is measured)."""
        found = self.shift(st)
        return (found.profile, found.why) if found is not None and found.kept is None else None

    def check(self) -> list[str]:
        """Follow the traffic of every model whose traffic moved; returns those models."""
        c, out = self.controller, []
        for model in c.fresh_models() or c.models():  # the tick's list and readings while fresh
            try:
                st = c.tick_reading(model) or c.model_state(model)
                found = self.shift(st)
                if found is None or st.mode is None:
                    continue
                library.keep(found.profile, c.planner.state_dir, model, st.mode)  # planned from until now
                if found.kept is not None:
                    self.reuse(model, found)
                    out.append(model)
                    continue
                again = _remeasure(found.profile, len(c.planner.cores))
                label = tuple(sorted(found.now.items()))
                c.planner.start_profile(st, **again, sizes=label,
                                        sizes_by_batch=sizes_by_batch(found.lately, range(1, again["max_batch"] + 1),
                                                                      label),
                                        then=lambda prof, model=model: self.replan(model))
            except BusyError:
                continue  # another profile runs: the next check
            except (OSError, PackratError) as exc:
                log.warning("re-profile of %s not started: %s", model, exc)
                continue
            self.tried[model] = (self.clock(), found.now)
            log.info("re-profile of %s started: %s", model, found.why)
            self.started.append((model, found.why))
            out.append(model)
        return out

    def reuse(self, model: str, found: Shift) -> dict[str, Any]:
        """Plan from the kept profile covering the traffic now (no re-profile, no gap)."""
        assert found.kept is not None
        library.restore(found.kept, self.controller.planner.state_dir, model)
        log.info("%s: %s; planning from the profile kept for it (%s)", model, found.why, found.kept.path.name)
        self.reused.append((model, found.why, str(found.kept.path)))
        return self.replan(model)

    def replan(self, model: str) -> dict[str, Any]:
        """After the re-profile: re-plan from it (class doc); what was done, for the job's result."""
        c = self.controller
        if c.policy is not None:
            return {"replan": "by the re-plan loop"}  # it reads the new profile on its next tick
        st = c.model_state(model)
        plan = c.planner.plan_for(st, plan_batch(st), st.plan.cores if st.plan is not None else None)
        swap = c.tuning.apply_choice(model, plan)
        return {"replan": "here", "plan": plan.to_dict(),
                "swap": swap if swap is not None else {"outcome": "not applied: pinned"}}

    def run(self, stop: threading.Event) -> None:
        _every(self.interval_s, self.check, stop, "re-profile")


def _remeasure(profile: Profile, usable: int) -> dict[str, Any]:
    """The grid of the profile measured again: its max batch, cores and budget (a profile
    without settings: its largest batch, every usable core, the tune's default budget)."""
    was = profile.extra.get("settings") or {}
    max_batch = was.get("max_batch") or max((p.batch for p in profile.points), default=1)
    cores = min(int(was.get("cores") or usable), usable)
    return {"max_batch": int(max_batch), "cores": cores, "budget_s": was.get("budget_s") or tune.DEFAULT_BUDGET_S}
