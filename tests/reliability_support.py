"""Helpers for the reliability tests: a private copy of the sleep model, polling."""

from __future__ import annotations

from collections.abc import Callable

from packrat.apply.swap import unread_bytes
from packrat.bench.sleepmodel import SLEEP_MODEL, copy_sleep_model  # noqa: F401 - the tests import them from here
from waiting import wait_until


def wait_for(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll `cond` until it holds (waiting.wait_until: a hang guard naming `what`)."""
    wait_until(cond, timeout_s, what)


def holding_unread(pids: list[int]) -> bool:
    """Every (stopped) worker in `pids` has a batch written to its socket and not read.

    The queue's pendingRequests is 0 both before a request reaches the queue and
    after a worker took it: only the unread bytes tell the two apart.
    """
    return all((unread_bytes(pid) or 0) > 0 for pid in pids)
