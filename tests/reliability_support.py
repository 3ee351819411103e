"""Helpers for the reliability tests: a private copy of the sleep model, polling."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from packrat.apply.swap import unread_bytes
from waiting import wait_until

SLEEP_MODEL = Path(__file__).parent / "data" / "observe" / "sleepmodel"


def copy_sleep_model(store: Path, name: str) -> Path:
    """The sleep model (sleeps a table latency per batch, claims its slot) as `name` in `store`."""
    base = store / name
    shutil.copytree(SLEEP_MODEL, base, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = json.loads((base / "MAR-INF" / "MANIFEST.json").read_text())
    manifest["model"]["modelName"] = name
    (base / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(manifest))
    return base


def wait_for(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll `cond` until it holds (waiting.wait_until: a hang guard naming `what`)."""
    wait_until(cond, timeout_s, what)


def holding_unread(pids: list[int]) -> bool:
    """Every (stopped) worker in `pids` has a batch written to its socket and not read.

    The queue's pendingRequests is 0 both before a request reaches the queue and
    after a worker took it: only the unread bytes tell the two apart.
    """
    return all((unread_bytes(pid) or 0) > 0 for pid in pids)
