"""Swaps on their own thread, one at a time, and the restart watch.

A second swap while one runs gets BusyError: the tick thread keeps deciding
while a swap takes its 10-60 s. The attempt is recorded whatever happens
(swaps.jsonl, packrat_swaps_total, packrat_swap_phase_seconds), and a
successful one becomes the model's last plan (last-plans.json).

The restart watch: each tick checks that the version of each model's last
successful swap is still loaded. When it is not (TorchServe restarted and
loaded the base model, or someone unregistered it), the last plan is applied
again, at most once per `reapply_backoff_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from packrat.apply import versions
from packrat.apply.client import ManagementClient
from packrat.apply.swap import Swapper
from packrat.control.history import History
from packrat.control.metrics import ControllerMetrics
from packrat.control.statefiles import LAST_PLANS_FILE, StateFiles
from packrat.errors import BusyError, ModeRefusedError, SwapError, TorchServeError
from packrat.types import Plan, SwapRecord

log = logging.getLogger("packrat.controller")


@dataclass
class SwapTask:
    """A swap handed to the swap thread; `done` is set when it finished either way."""

    model: str
    plan: Plan
    cores: tuple[int, ...]  # where the new version's workers pin
    current: tuple[str, str] | None = None  # (version, url) live when the swap began, read under the lock
    done: threading.Event = field(default_factory=threading.Event)
    record: SwapRecord | None = None
    error: BaseException | None = None
    reapply: bool = False  # the restart watch's: the last plan applied again


class Swaps:
    """The swap thread's one-at-a-time lock, the running swap, and the restart watch."""

    def __init__(self, swapper: Swapper, client: ManagementClient, files: StateFiles, history: History,
                 metrics: ControllerMetrics, clock: Callable[[], float], reapply_backoff_s: float,
                 cores: Sequence[int], share_of: Callable[[str], tuple[int, ...]]) -> None:
        self.swapper, self.client, self.files, self.history = swapper, client, files, history
        self.metrics, self.clock, self.reapply_backoff_s = metrics, clock, reapply_backoff_s
        self.cores = tuple(cores)
        self.share_of = share_of
        # One swap at a time per controller (REST calls and ticks share it).
        self.lock: Any = threading.Lock()  # Any: a test counts its acquisitions
        self.running: SwapRecord | None = None
        # Told each time the lock is let go: a caller waits for it rather than polling.
        self._freed = threading.Condition()
        self._releases = 0
        self._reapply_after: dict[str, float] = {}

    @property
    def releases(self) -> int:
        """How many times the swap lock was let go (each swap's end): a model reading taken
        before this changed may be stale (packrat.control.loop keeps idle models' readings)."""
        return self._releases

    def _release(self) -> None:
        self.lock.release()
        with self._freed:
            self._releases += 1
            self._freed.notify_all()

    # -- starting a swap -----------------------------------------------------------
    def start(self, model: str, plan: Plan) -> SwapTask:
        """Start swapping `model` to `plan` on the swap thread and return at once.
        BusyError while another swap runs (see Controller.start_swap)."""
        if not self.lock.acquire(blocking=False):
            raise BusyError("a swap is already running; try again when it is done")
        return self.start_locked(model, plan)

    def swap_cores(self, model: str, plan: Plan) -> tuple[int, ...]:
        """The cores a new version of `model` running `plan` pins to: its share when the plan
        fits there, else every usable core."""
        share = self.share_of(model)
        return share if plan.threads_used <= len(share) else self.cores

    def start_locked(self, model: str, plan: Plan, reapply: bool = False) -> SwapTask:
        """start() for a caller that holds the lock; the swap thread releases it."""
        try:
            versions.validate_plan(plan, len(self.cores))
            # TorchServeError 404 for an unknown model, before anything; read under the lock,
            # so it is what the swap replaces.
            current = self.swapper.current(model)
            cores = self.swap_cores(model, plan)
            if plan.cores > len(cores):  # made for every core (an explicit plan), fits the model's share
                plan = replace(plan, cores=len(cores))
            task = SwapTask(model, plan, cores, current, reapply=reapply)
            self.running = SwapRecord(model, None, None, plan, self.clock(), phase="starting")
            self.metrics.swap_running.set(1)
            threading.Thread(target=self._run, args=(task,), name=f"packrat-swap-{model}",
                             daemon=True).start()
        except BaseException:
            self.running = None
            self.metrics.swap_running.set(0)
            self._release()
            raise
        return task

    def apply(self, model: str, plan: Plan) -> SwapRecord:
        """Swap `model` to `plan` and wait for the result."""
        task = self.start(model, plan)
        task.done.wait()
        if task.error is not None:
            raise task.error
        assert task.record is not None
        return task.record

    def apply_when_free(self, model: str, plan: Plan, timeout_s: float,
                        wanted: Callable[[], bool] = lambda: True) -> SwapRecord | None:
        """apply(), waiting up to `timeout_s` for a running swap (the re-plan loop's, a REST
        apply) to end first; BusyError when none ended in time. None, and nothing applied, when
        `wanted()` turns false before it starts (an operator pinned the model meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._freed:
                seen = self._releases
            if not wanted():
                return None
            try:
                return self.apply(model, plan)
            except BusyError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                with self._freed:
                    self._freed.wait_for(lambda: self._releases != seen, left)

    def _run(self, task: SwapTask) -> None:
        try:
            record = self.swapper.apply(task.model, task.plan, on_phase=self._on_phase, cores=task.cores,
                                        current=task.current)
            task.record = record
            self.metrics.swaps.labels(task.model, record.outcome).inc()
            self.metrics.observe_phases(record)
            self.history.append_quietly(record.to_dict())
            try:
                self.files.remember(record)  # before the lock is released: the restart watch reads it
            except OSError:
                log.exception("could not save %s", self.files.dir / LAST_PLANS_FILE)
        except SwapError as exc:
            task.error = exc
            outcome = exc.record.outcome if exc.record is not None else "failed"
            self.metrics.swaps.labels(task.model, outcome).inc()
            if exc.record is not None:
                self.metrics.observe_phases(exc.record)
                self.history.append_quietly(exc.record.to_dict())
            if isinstance(exc, ModeRefusedError) and task.reapply:
                # Its workers refuse that mode here now (another CPU under the same state dir,
                # say): every 30 s it would load and be refused again. The live version serves on.
                log.warning("%s: the last plan's mode is refused here (%s); not applying it again", task.model, exc)
                self.files.forget(task.model)
        except BaseException as exc:  # reported to the caller; the swap thread must not die silently
            task.error = exc
            self.metrics.swaps.labels(task.model, "error").inc()
            log.exception("swap of %s failed", task.model)
        finally:
            self.running = None
            self.metrics.swap_running.set(0)
            self._release()
            task.done.set()

    def _on_phase(self, record: SwapRecord) -> None:
        self.running = record

    # -- the restart watch -----------------------------------------------------------
    def watch(self, models: Sequence[str], default_urls: Mapping[str, str] | None = None,
              busiest: Callable[[list[str]], list[str]] | None = None) -> list[str]:
        """Apply the last plan again where its version is no longer loaded; returns those models.

        The version a successful swap made live stays loaded until the next swap
        replaces it. If TorchServe no longer lists it, TorchServe restarted (and
        loaded the base model, or nothing) or someone unregistered it: the plan
        the controller last made live is made live again. `default_urls`: model ->
        the URL of its default version, as TorchServe's list of models gave it this tick;
        a model whose default is the last swap's version needs no describe call.
        `busiest`: orders models by their traffic, asked only when more than one may be
        lost (a restart): one swap at a time, the model under load goes first.
        """
        # Looked for without the swap lock: holding it for every tick's describe calls
        # would refuse an apply arriving meanwhile (BusyError) for no swap at all.
        unsure = self._unsure(models, default_urls)
        if busiest is not None and len(unsure) > 1:
            first = busiest([model for model, _entry in unsure])
            models = first + [m for m in models if m not in first]
            unsure = sorted(unsure, key=lambda found: first.index(found[0]))
        if not any(self._lost(model, entry) for model, entry in unsure):
            return []
        # Acted on under the swap lock, checked again: a swap changes versions on purpose,
        # and one that ends between reading last-plans.json and acting must not be undone.
        if not self.lock.acquire(blocking=False):
            return []
        handed_over = False
        try:
            for model, entry in self._unsure(models, default_urls):
                if not self._lost(model, entry):
                    continue
                self._reapply_after[model] = self.clock() + self.reapply_backoff_s
                self.metrics.lost_versions.labels(model).inc()
                log.warning("%s: version %s of the last swap is no longer loaded (TorchServe restarted?); "
                            "applying its plan again", model, entry.get("version"))
                # Its directory outlived it (TorchServe stopped before a swap could retire it).
                self.swapper.retire_dir(str(entry.get("url")))
                plan = Plan.from_dict(entry["plan"])
                handed_over = True  # start_locked releases the lock, also when it fails
                self.start_locked(model, plan, reapply=True)
                self.metrics.reapplies.labels(model).inc()
                return [model]  # one swap at a time
            return []
        finally:
            if not handed_over:
                self._release()

    def lost_plan(self, model: str, loaded: Sequence[str]) -> dict[str, Any] | None:
        """For status: the last swap's version and plan while none of the `loaded` versions of
        `model` is that version and no swap of it runs, i.e. what the restart watch is about to
        apply again (right after a restart the tune's "applied ..." reads as if it were live);
        `retry_in_s`: how long its backoff still holds it. None otherwise."""
        entry = self.files.last_plans().get(model)
        running = self.running
        if not entry or entry.get("version") in loaded or (running is not None and running.model == model):
            return None
        return {"version": entry.get("version"), "plan": entry.get("plan"),
                "retry_in_s": round(max(0.0, self._reapply_after.get(model, 0.0) - self.clock()), 1)}

    def _unsure(self, models: Sequence[str],
                default_urls: Mapping[str, str] | None) -> list[tuple[str, dict[str, Any]]]:
        """(model, last-plans.json entry) of the `models` whose last swap's version may be lost: all
        but those whose default version, as TorchServe listed it (`default_urls`), is that version;
        in the order of `models` (the tick's: those with traffic first)."""
        quick = default_urls or {}
        plans = self.files.last_plans()
        return [(model, plans[model]) for model in models
                if model in plans and (plans[model].get("url") is None or quick.get(model) != plans[model].get("url"))]

    def _lost(self, model: str, entry: dict[str, Any]) -> bool:
        """The version of `model`'s last swap is not loaded, and its re-apply is not backing off."""
        if self.clock() < self._reapply_after.get(model, 0.0):
            return False
        try:
            loaded = {d.version for d in self.client.describe_versions(model)}
        except TorchServeError:
            return False
        return entry.get("version") not in loaded
