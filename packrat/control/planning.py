"""Which profile a model is planned from, the plans made from it, and re-profiling.

Each call takes the ModelState its request already read (never reads it again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from packrat.apply import versions
from packrat.apply.swap import Swapper
from packrat.control.live import base_of, require_plannable
from packrat.control.modecheck import mode_refusal
from packrat.control.traffic import plan_batch, profile_shape
from packrat.control.values import ModelState
from packrat.errors import ConfigError, PackratError, ProfileError
from packrat.jobs import Job, Jobs, Turns
from packrat.plan import plan_from_shape, realizable_plan
from packrat.profile import ProfileSettings, load_profile, open_archive, run_profile, save_profile
from packrat.profile.fingerprint import mode_from_config
from packrat.profile.identity import archive_in_mode
from packrat.profile.library import profile_file, usable_profiles
from packrat.types import Plan, Profile

log = logging.getLogger("packrat.controller")


class Planner:
    def __init__(self, state_dir: Path, model_store: Path, swapper: Swapper, cores: Sequence[int],
                 jobs: Jobs, turns: Turns) -> None:
        self.state_dir, self.model_store, self.swapper = state_dir, model_store, swapper
        self.cores = tuple(cores)
        self.jobs, self.turns = jobs, turns

    def profile_path(self, model: str) -> Path:
        """Where a profile made through the REST API (or placed by hand) lives."""
        return self.state_dir / "profiles" / f"{model}.json"

    def profile(self, st: ModelState) -> Profile:
        """The profile the controller plans `st.model` from; ProfileError when there is none.

        The per-mode profile of the live mode when it is still valid for the base
        archive and this machine (packrat.profile.library), else a profile placed
        at profile_path(model)."""
        live = self._live_mode_profile(st)
        if live is not None:
            return live
        path = self.profile_path(st.model)
        if not path.exists():
            raise ProfileError(
                f"no profile for {st.model!r} at {path}: POST /v1/models/{st.model}/profile first "
                "(or place a `packrat profile` output there)"
            )
        return load_profile(path)

    def _live_mode_profile(self, st: ModelState) -> Profile | None:
        return self.mode_profile(st, st.mode) if st.mode is not None else None

    def mode_profile(self, st: ModelState, mode: str) -> Profile | None:
        """The model's per-mode profile of `mode`, when still valid for the base archive and
        this machine (packrat.profile.library); None when there is none."""
        _, base_dir = base_of(self.swapper, self.model_store, st)
        for prof in usable_profiles(self.state_dir, st.model, base_dir):
            if prof.fingerprint is not None and prof.fingerprint.mode == mode:
                return prof
        return None

    def _profile_in(self, st: ModelState, mode: str) -> Profile:
        """The profile to plan `st.model` from in `mode` (an operator's choice); ProfileError
        when that mode was never profiled here."""
        if mode == st.mode:
            return self.profile(st)
        found = self.mode_profile(st, mode)
        if found is None:
            raise ProfileError(
                f"no profile of {st.model!r} in {mode} for this archive and machine: tune with that mode "
                f'(POST /v1/models/{st.model}/tune {{"modes": ["{mode}"]}}) or give explicit `instances`')
        return found

    def check_mode(self, st: ModelState, mode: str) -> None:
        """ConfigError naming why `st.model` may not run `mode` (packrat.control.modecheck)."""
        base, base_dir = base_of(self.swapper, self.model_store, st)
        why = mode_refusal(self.state_dir, st, base, base_dir, mode)
        if why:
            raise ConfigError(why)

    def tick_profiles(self, st: ModelState) -> tuple[Profile, ...]:
        """The per-mode profiles of `st.model` usable now (archive hash and fingerprint checked)."""
        if st.mode is None:
            return ()
        _, base_dir = base_of(self.swapper, self.model_store, st)
        try:
            return usable_profiles(self.state_dir, st.model, base_dir)
        except (OSError, PackratError) as exc:
            log.warning("%s: per-mode profiles unusable: %s", st.model, exc)
            return ()

    def live_mode_override(self, st: ModelState) -> str | None:
        """The live mode when it is not the base archive's own (a plan must keep it), else None."""
        _, base_dir = base_of(self.swapper, self.model_store, st)
        base_mode = versions.served_mode(base_dir)
        return st.mode if st.mode is not None and st.mode != base_mode else None

    def plan_for(self, st: ModelState, batch: int, cores: int | None = None, mode: str | None = None) -> Plan:
        """The optimiser's realisable plan for load `batch` from the model's profile in `mode`
        (default: its live mode)."""
        ncores = cores or len(self.cores)
        if ncores > len(self.cores):
            raise ConfigError(f"cores {ncores} exceeds the {len(self.cores)} usable cores")
        require_plannable(st, "its workers would not pin to a plan")
        if mode is not None:
            self.check_mode(st, mode)
        profile = self.profile(st) if mode is None else self._profile_in(st, mode)
        plan = realizable_plan(profile, ncores, batch)
        found = profile.fingerprint.mode if profile.fingerprint is not None else None
        return replace(plan, mode=mode or found or self.live_mode_override(st))

    def explicit_plan(self, st: ModelState, shape: Sequence[tuple[int, int]], mode: str | None = None) -> Plan:
        """A plan of the given (threads, batch cap) workers in `mode` (default: the live mode),
        predicted from that mode's profile if it has them."""
        # A swap to it would wait its whole ready timeout for workers that never report a pin.
        require_plannable(st, "its workers would not pin to a plan")
        if mode is not None:
            self.check_mode(st, mode)
        try:
            profile: Profile | None = self.profile(st) if mode is None else self._profile_in(st, mode)
        except ProfileError:
            profile = None  # explicit plans need no profile; they just have no prediction
        return replace(plan_from_shape(shape, len(self.cores), profile), mode=mode or self.live_mode_override(st))

    def start_profile(self, st: ModelState, *, max_batch: int, budget_s: float | None,
                      cores: int | None = None, sizes: tuple[tuple[str, int], ...] | None = None,
                      sizes_by_batch: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] | None = None,
                      then: Callable[[Profile], dict[str, Any]] | None = None) -> Job:
        """Re-profile the model in its live mode in the background; the job says when it is done.

        The profile goes where tuning and the re-plan loop read it:
        <state dir>/profiles/<model>/<mode>.json (packrat.profile.library). `then`: called
        with the saved profile in the job (e.g. to re-plan); what it returns joins the result.
        `sizes`: the request sizes to time, the profile's label, and `sizes_by_batch` the batches
        timed at other sizes (packrat.profile.shape.sizes_by_batch; none given: every batch at
        `sizes`); sizes None: both the traffic's since the workers started (its label at the
        live plan's load batch, each batch padded to its longest request)."""
        require_plannable(st, "nothing to profile")
        _, base_dir = base_of(self.swapper, self.model_store, st)
        if sizes is None:
            label, by_batch = profile_shape(st, plan_batch(st), max_batch)
        else:
            label, by_batch = sizes, sizes_by_batch or ()
        settings = ProfileSettings(cores=cores or len(self.cores), max_batch=max_batch, budget_s=budget_s,
                                   sizes=label, sizes_by_batch=by_batch)
        settings.validate(len(self.cores))
        archive = open_archive(base_dir)
        if st.mode is not None:
            archive = archive_in_mode(archive, st.mode)
        out = profile_file(self.state_dir, st.model, mode_from_config(archive.config))

        def run() -> dict[str, Any]:
            prof = run_profile(archive, settings, progress=False, log_path=out.with_suffix(".log"))
            save_profile(prof, out)
            done = {"profile_path": str(out), "points": len(prof.points)}
            return {**done, **then(prof)} if then is not None else done

        return self.jobs.start("profile", st.model, run, turns=self.turns)
