"""The state dir's files and the two locks: one controller per state dir and per TorchServe.

What TorchServe does not know lives in the state dir (`.packrat/` by default):
    swaps.jsonl        one line per swap attempt (packrat.control.history)
    policy-state.json  the re-plan policy's state, per model
    last-plans.json    per model, the version and plan the last successful swap made live
    profiles/<m>/<mode>.json  one profile per execution mode (packrat.profile.library)
    tune/<m>.json      the last tune of each model: stages, modes, refusals, choice
    cores.json         how the usable cores are divided among the models (packrat.plan.share)
    pins.json          the models an operator pinned to a (mode, plan) (packrat.control.pins)
    profiles/<m>.json  profiles made through the REST API
    controller.lock    flock: one controller per state dir

One controller per TorchServe: it also holds an flock on
`<model store>/.packrat-controller.lock`. Every controller of a TorchServe
must use that TorchServe's model store (versions are registered by their
directory name in it), whatever path it is given, and two controllers on one
store would also number and delete each other's version directories.
TorchServe skips hidden files when it scans the store.

Every JSON file is written then renamed with fsync (a crash leaves the old file
or the new one) and read as {} when missing or unreadable (a restart starts afresh).
The policy's state is kept in memory and written once per tick, only when it changed:
at once when a decision's part changed, at most every POLICY_STATE_QUIET_S when only the
parts that move every tick did (an estimator's sample window: a restart after a crash
resumes from an estimate at most that old), and whatever is newer on a clean stop.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from packrat.errors import ConfigError
from packrat.types import SwapRecord

POLICY_STATE_FILE = "policy-state.json"
LAST_PLANS_FILE = "last-plans.json"
CORES_FILE = "cores.json"
PINS_FILE = "pins.json"
STATE_LOCK_FILE = "controller.lock"
POLICY_STATE_QUIET_S = 30.0  # how stale the persisted parts that move every tick may get
# In the model store: one controller per TorchServe (hidden: TorchServe's store scan skips it).
STORE_LOCK_FILE = ".packrat-controller.lock"


def read_state(path: Path) -> dict[str, Any]:
    """A JSON object from the state dir; {} when missing or unreadable (a restart starts afresh)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_state(path: Path, data: dict[str, Any]) -> None:
    """Write-then-rename with fsync: a crash leaves the old file or the new one, never half."""
    _write_text(path, json.dumps(data, indent=1, default=str))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _without(value: Any, paths: tuple[str, ...]) -> Any:
    """`value` (a model's policy state) without the keys `paths` name ("a", or "a.b" in "a")."""
    if not isinstance(value, dict) or not paths:
        return value
    here = {p for p in paths if "." not in p}
    below: dict[str, tuple[str, ...]] = {}
    for p in paths:
        if "." in p:
            head, rest = p.split(".", 1)
            below[head] = below.get(head, ()) + (rest,)
    return {k: _without(v, below.get(k, ())) for k, v in value.items() if k not in here}


def _decisive(state: dict[str, Any], quiet: tuple[str, ...]) -> dict[str, Any]:
    """The policy's state without each model's `quiet` keys (a change only there may wait)."""
    return {m: _without(s, quiet) for m, s in state.items()}


def flock(path: Path, busy: str) -> int:
    """Take an exclusive flock on `path` (never through a symlink); ConfigError(busy) if held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        try:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)
        raise ConfigError(f"{busy} ({path}: {holder or 'holder unknown'})") from exc
    return fd


class StateFiles:
    """The state dir: its locks, the last plans, the policy's state and the division of cores."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "profiles").mkdir(exist_ok=True)
        self._lock_fds: list[int] = []
        self._policy: dict[str, Any] | None = None  # the policy's state as last read or saved
        # What the file holds, as json.loads gives it back (whole, and without the quiet keys):
        # compared with the state kept, so an unchanged tick costs no json.dumps.
        self._policy_written: tuple[Any, Any] = (None, None)
        self._policy_text = ""  # the file's text
        self._policy_written_at = 0.0  # time.monotonic() of that write
        self._pins: dict[str, Any] | None = None  # pins.json as last read or saved

    # -- locks -------------------------------------------------------------------
    def acquire(self, model_store: Path, holder: str) -> None:
        """Take the state dir's lock and the model store's: one controller per TorchServe.

        The model store is the TorchServe's own: every controller of it must
        create its version directories there, so its lock is held by exactly the
        controllers that could fight over that TorchServe (see the module docstring).
        """
        fds = [flock(self.dir / STATE_LOCK_FILE, f"another controller uses the state dir {self.dir}")]
        try:
            fds.append(flock(Path(model_store) / STORE_LOCK_FILE,
                             "another controller manages the TorchServe of this model store"))
        except BaseException:
            os.close(fds[0])
            raise
        for fd in fds:
            os.ftruncate(fd, 0)
            os.write(fd, f"{holder}\n".encode())
        self._lock_fds = fds

    def release(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = []

    # -- the last plan each model's last successful swap made live -----------------
    def last_plans(self) -> dict[str, dict[str, Any]]:
        return read_state(self.dir / LAST_PLANS_FILE)

    def save_last_plans(self, plans: dict[str, dict[str, Any]]) -> None:
        write_state(self.dir / LAST_PLANS_FILE, plans)

    def remember(self, record: SwapRecord) -> None:
        plans = self.last_plans()
        plans[record.model] = {"version": record.to_version, "url": f"{record.model}.{record.to_version}",
                               "plan": record.plan.to_dict()}
        self.save_last_plans(plans)

    def forget(self, model: str) -> None:
        """Drop `model`'s last plan: the restart watch no longer applies it again."""
        plans = self.last_plans()
        if plans.pop(model, None) is not None:
            self.save_last_plans(plans)

    # -- the re-plan policy's state, and the division of cores ------------------------
    def policy_state(self) -> dict[str, Any]:
        """The policy's state: read from the file once, then what was last saved."""
        if self._policy is None:
            self._policy = read_state(self.dir / POLICY_STATE_FILE)
        return self._policy

    def save_policy_state(self, state: dict[str, Any], quiet: tuple[str, ...] = (), *,
                          flush: bool = False) -> bool:
        """Keep `state`; write it when it differs from the file. A change only under a model's
        `quiet` keys ("a" or "a.b", a key inside "a") waits up to POLICY_STATE_QUIET_S (unless `flush`). True: written."""
        self._policy = state
        if state == self._policy_written[0]:
            return False
        now = time.monotonic()
        if (not flush and now - self._policy_written_at < POLICY_STATE_QUIET_S
                and _decisive(state, quiet) == self._policy_written[1]):
            return False
        text = json.dumps(state, indent=1, default=str)
        if text == self._policy_text:  # equal once written (a policy's tuples come back as lists)
            return False
        _write_text(self.dir / POLICY_STATE_FILE, text)
        written = json.loads(text)  # a copy of its own: the caller goes on changing `state` in place
        self._policy_written, self._policy_written_at = (written, _decisive(written, quiet)), now
        self._policy_text = text
        return True

    def flush_policy_state(self, quiet: tuple[str, ...] = ()) -> bool:
        """Write the policy's state kept in memory if the file is behind it (a clean stop)."""
        return self._policy is not None and self.save_policy_state(self._policy, quiet, flush=True)

    def saved_division(self) -> dict[str, Any] | None:
        return read_state(self.dir / CORES_FILE).get("division")

    def save_division(self, data: dict[str, Any]) -> None:
        write_state(self.dir / CORES_FILE, data)

    # -- operator pins ---------------------------------------------------------------
    def pins(self) -> dict[str, dict[str, Any]]:
        """A copy of the pins: read from the file once, then what was last saved (the controller
        holds the state dir's lock: nothing else writes it; every tick asks per model)."""
        if self._pins is None:
            self._pins = read_state(self.dir / PINS_FILE)
        return copy.deepcopy(self._pins)

    def save_pins(self, pins: dict[str, dict[str, Any]]) -> None:
        write_state(self.dir / PINS_FILE, pins)
        self._pins = copy.deepcopy(pins)
