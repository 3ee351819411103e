"""Whether an operator may set a model to an execution mode (an apply with `mode`).

A mode is refused, with the reason, when

  - it is not "<precision>-<runtime>" of known names (packrat.modes);
  - the live version is not a Packrat archive (it has no modes);
  - the model's last tune refused it for this archive: its accuracy guard failed,
    or the worker refused the precision (packrat.tune's record, tune/<m>.json);
  - this machine cannot run it for this archive (packrat.tune.unsupported: the CPU's
    bf16/int8 flags, which runtimes import, the task's rules).

The live mode and the archive's own mode are always allowed: they serve already.
What the machine runs comes from the last tune's record when it was made for this
archive and machine with the same libraries installed (its probe's capabilities:
packrat.tune.run.capabilities_for), else from a fresh probe of the archive
(packrat.profile.probe: a child interpreter, a few seconds).
"""

from __future__ import annotations

from pathlib import Path

from packrat import tune
from packrat.apply import versions
from packrat.control.values import ModelState
from packrat.modes import ExecutionMode
from packrat.tune.run import capabilities_for


def mode_refusal(state_dir: Path, st: ModelState, base: str, base_dir: Path, mode: str) -> str | None:
    """Why `st.model` may not run `mode` now (None: it may). `mode` is normalised (lower case)."""
    try:
        why = ExecutionMode.parse(mode).unknown()
    except ValueError as exc:
        return str(exc)
    if why:
        return f"{mode}: {why}"
    if st.mode is None:
        return f"{st.model}'s live version is not a Packrat archive: it has no execution modes"
    if mode in (st.mode, versions.served_mode(base_dir)):
        return None
    record = tune.load_record(state_dir, st.model)
    key = tune.tune_key(base_dir, base)
    entry = record.modes.get(mode) if record is not None else None
    if entry is not None and entry.state == "refused" and entry.model_id in (None, key["model_id"]):
        reason = " ".join((entry.reason or "").split())[:500]
        return f"{mode} failed its accuracy guard for {st.model} in the last tune: {reason}"
    why = tune.unsupported(mode, capabilities_for(record, key, base_dir)[0])
    return f"{mode} is not supported for {st.model} on this machine: {why}" if why else None
