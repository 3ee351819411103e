"""Tuning: every model to its fastest measured execution mode and shape, by itself.

    candidate_modes(caps, requested)      which modes to try here (packrat.tune.modes, pure)
    tune_model(base_dir, model, ...)      guard + profile each mode, choose (mode, plan)
    Tracker                               the stage a tune is at (status, persisted record)
    tune_key(base_dir, base)              what a tune result is valid for (archive hash, machine)

Below the controller: it uses the profiler and the optimiser, never TorchServe;
the controller applies the choice through its swap (packrat.control) and
decides when to (re-)tune (packrat.control.tuning: AutoTuner). See docs/tuning.md.
"""

from __future__ import annotations

from packrat.tune.modes import SHORTLIST, candidate_modes, unsupported
from packrat.tune.run import (
    DEFAULT_BATCH,
    DEFAULT_BUDGET_S,
    DEFAULT_POINT_BUDGET_S,
    Tracker,
    TuneResult,
    TuneSettings,
    describe,
    load_record,
    record_path,
    requested_modes,
    tune_key,
    tune_model,
)

__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_BUDGET_S",
    "DEFAULT_POINT_BUDGET_S",
    "SHORTLIST",
    "Tracker",
    "TuneResult",
    "TuneSettings",
    "candidate_modes",
    "describe",
    "load_record",
    "record_path",
    "requested_modes",
    "tune_key",
    "tune_model",
    "unsupported",
]
