"""How long the controller's cores have been mostly idle, read from /proc/stat at each check.

A tune timed while other work had the cores (a build, a test run, another service) keeps
inflated figures for its several-thread points (packrat.profile.contention marks them
"contended": no correction is defensible there), and its choice can be wrong for as long
as the archive does not change. The auto-tuner measures such modes again once the
machine is quiet: this says since when it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from packrat.cores import read_cpu_ticks

IDLE_AT = 0.6  # the cores' idle share over a check's interval from which it counts as quiet


class Quiet:
    """update() at each check: seconds the given cores have been at least IDLE_AT idle,
    from check to check without a busier interval between (0.0 until two readings)."""

    def __init__(self, cores: Iterable[int], clock: Callable[[], float] = time.monotonic,
                 read: Callable[[], Mapping[int, tuple[int, int]]] = read_cpu_ticks) -> None:
        self.cores = tuple(cores)
        self._clock, self._read = clock, read
        self._last: tuple[float, dict[int, tuple[int, int]]] | None = None
        self._since: float | None = None
        self.idle_share: float | None = None  # over the last interval, for logs and tests

    def update(self) -> float:
        now, ticks = self._clock(), dict(self._read())
        if self._last is not None:
            then, before = self._last
            idle = sum(ticks[c][0] - before[c][0] for c in self.cores if c in ticks and c in before)
            total = sum(ticks[c][1] - before[c][1] for c in self.cores if c in ticks and c in before)
            self.idle_share = idle / total if total > 0 else None
            if self.idle_share is not None and self.idle_share >= IDLE_AT:
                self._since = then if self._since is None else self._since
            else:
                self._since = None
        self._last = (now, ticks)
        return 0.0 if self._since is None else now - self._since
