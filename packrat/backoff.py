"""How long to wait before starting a crashed helper again (the fork server beside TorchServe,
the controller under --restart-on-crash): one that cannot start must not spin."""

from __future__ import annotations

from dataclasses import dataclass, field


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
