"""What counts as a crash of a kept process, and how long to wait before starting it again
(the fork server beside TorchServe, TorchServe's frontend under packrat-torchserve, the
controller under --restart-on-crash): one that cannot start must not spin."""

from __future__ import annotations

import signal
from collections.abc import Collection
from dataclasses import dataclass, field

# The signals that stop a kept process on purpose (a `kill`, Ctrl-C, a closed terminal).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The exit statuses of a process that caught one of them and exited as asked (a JVM: 143).
STOPPED_EXITS = frozenset(128 + s for s in STOP_SIGNALS)


def crashed(returncode: int, lived_s: float, min_uptime_s: float, stop_exits: Collection[int] = ()) -> bool:
    """Killed by a signal other than a stop signal (SIGKILL: an OOM kill; SIGSEGV, SIGABRT), or a
    non-zero exit other than `stop_exits` after `min_uptime_s`: a sooner one is a start-up
    refusal (a port taken, a bad flag), which starting again would only repeat."""
    if returncode < 0:
        return -returncode not in STOP_SIGNALS
    return returncode != 0 and returncode not in stop_exits and lived_s >= min_uptime_s


def how_it_ended(returncode: int) -> str:
    """'was killed by SIGKILL', 'exited with 3': a Popen returncode in words."""
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


@dataclass
class Backoff:
    first_s: float = 1.0  # before the first restart
    max_s: float = 60.0  # the delay doubles up to this while restarts come quickly
    stable_s: float = 60.0  # a process that lived this long starts the doubling over
    _next_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._next_s = self.first_s

    def after(self, lived_s: float) -> float:
        """The delay before starting again a process that ended after `lived_s` seconds."""
        if lived_s >= self.stable_s:
            self._next_s = self.first_s
        delay = self._next_s
        self._next_s = min(2 * delay, self.max_s)
        return delay
