"""Tuning on by default: the controller tunes every Packrat model it manages, by itself.

`AutoTuner.check()` runs every `interval_s` on its own thread beside the
controller's tick and starts a tune (Controller.start_tune, queued: one
measures at a time) for each Packrat model whose last tune

  - does not exist                 (a model seen for the first time: `make run`,
                                    or a TorchServe the user started and attached to),
  - was made for another key       (the base archive's content hash changed: a new
                                    archive version registered; or the machine's
                                    fingerprint changed: CPU, cores, allocator, torch),
  - was interrupted                (the controller stopped mid-tune).

A tune that failed for the same key is not retried automatically (it would
fail again in a loop); POST /v1/models/{m}/tune retries it. Models whose
live version is not a Packrat archive are left alone. Every per-mode profile
is also checked against hash and fingerprint wherever it is used
(packrat.profile.library), so between two checks nothing plans from a stale one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from packrat.control import Controller
from packrat.errors import BusyError, PackratError

log = logging.getLogger("packrat.autotune")


def why_tune(record: dict[str, Any] | None, key: dict[str, Any], running: bool) -> str | None:
    """Why a model with this last tune record needs tuning now (None: it does not). Pure."""
    if running:
        return None
    if record is None:
        return "never tuned"
    if record.get("key") != key:
        old = record.get("key") or {}
        if old.get("base") != key.get("base") or old.get("model_id") != key.get("model_id"):
            return "new archive version" if old else "never finished"
        return "machine fingerprint changed"
    if record.get("state") not in ("done", "failed"):
        return "interrupted"
    return None


class AutoTuner:
    def __init__(self, controller: Controller, interval_s: float = 10.0, *,
                 modes: Sequence[str] | None = None, budget_s: float | None = None,
                 batch: int | None = None, max_batch: int | None = None,
                 point_budget_s: float | None = None) -> None:
        self.controller = controller
        self.interval_s = interval_s
        # What every automatic tune asks for (None: Controller.start_tune's defaults).
        self.tune_args: dict[str, Any] = {"modes": list(modes) if modes else None, "budget_s": budget_s,
                                          "batch": batch, "max_batch": max_batch,
                                          "point_budget_s": point_budget_s}
        self.started: list[tuple[str, str]] = []  # (model, why), for logs and tests

    def check(self) -> list[str]:
        """Start a tune for every model that needs one; returns those models."""
        c = self.controller
        out = []
        for model in c.models():
            try:
                st = c.model_state(model)
                key = c.tune_key(model, st)
                if key is None:
                    continue  # not a Packrat archive
                running = c.jobs.unfinished("tune", model) is not None
                why = why_tune(c.tune_status(model) if not running else None, key, running)
                if why is None:
                    continue
                c.start_tune(model, trigger=f"auto: {why}", **self.tune_args)
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
        while True:
            try:
                self.check()
            except Exception:
                log.exception("auto-tune check failed; continuing")
            if stop.wait(self.interval_s):
                return
