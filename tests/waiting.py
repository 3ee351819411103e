"""Waiting in tests: for a condition, never for a duration.

A test that sleeps and then asserts is a speed assertion in disguise: on a busy
2-core machine the sleep is sometimes too short. `wait_until` polls instead, with a
generous timeout whose only job is to stop a test that is stuck; its failure says
so, so nobody reads it as "too slow" and raises a number.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout_s: float, what: str, step_s: float = 0.05) -> T:
    """Poll `cond` until it returns something truthy and return that; after `timeout_s`,
    AssertionError naming `what` as stuck (a hang guard, not a speed bound)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"stuck: {what} did not happen within {timeout_s:g} s "
                                 "(a hang guard, not a speed bound)")
        time.sleep(step_s)
