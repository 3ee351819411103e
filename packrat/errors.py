"""All Packrat exceptions.

    PackratError
    ├── ConfigError          bad settings, CLI arguments or plan input
    ├── ProfileError         a profile file is missing, malformed or unusable
    │   └── ProfileMismatchError   measured on another machine/model/mode
    ├── PlanError            no feasible plan for the given cores and batch
    ├── ArchiveError         building a model archive failed
    ├── TorchServeError      TorchServe's REST API answered with an error (translated in packrat.apply only)
    ├── ServerError          a TorchServe process did not start, or its workers did not come up
    ├── SwapError            applying a plan failed (and was rolled back); carries its record
    │   └── ModeRefusedError     the new workers refused its mode (accuracy guard, precision)
    └── BusyError            a swap or a profiling job is already running
"""

from __future__ import annotations

import re

from packrat.types import SwapRecord


def root_cause(exc: BaseException) -> str:
    """The reason at the bottom of requests' wrapped errors ("Connection refused"), else the
    whole text: their repr nests pools, URLs and object addresses around it."""
    found = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(exc))
    return found.group(1).strip() if found else str(exc)


class PackratError(Exception):
    """Base of every error Packrat raises on purpose."""


class ConfigError(PackratError):
    pass


class ProfileError(PackratError):
    pass


class ProfileMismatchError(ProfileError):
    pass


class PlanError(PackratError):
    pass


class ArchiveError(PackratError):
    pass


def is_mode_refusal(message: str) -> bool:
    """An error text that is a verdict on an execution mode, not an accident: the handler's
    accuracy guard refused it, or the CPU lacks its precision (packrat_tasks' own errors),
    whether quoted by a profiler's failure or a worker's load error."""
    return any(k in message for k in ("AccuracyGuardError", "PrecisionError", "REFUSED"))


class TorchServeError(PackratError):
    """An error answer from TorchServe's REST API (translated only in packrat.apply)."""

    def __init__(self, method: str, url: str, status: int, body: str) -> None:
        self.method = method
        self.url = url
        self.status = status
        self.body = body
        if status == 0 and body.startswith("unreachable: "):  # no answer at all (unreachable())
            super().__init__(f"{method} {url}: TorchServe does not answer ({body.removeprefix('unreachable: ')[:500]})")
        elif status == 0:  # nothing asked of TorchServe: its files (the key file) unreadable
            super().__init__(f"{method} {url}: {body[:500]}")
        else:
            super().__init__(f"{method} {url} -> HTTP {status}: {body[:500]}")

    @classmethod
    def unreachable(cls, method: str, url: str, exc: BaseException) -> "TorchServeError":
        """No answer from TorchServe (refused, timed out): status 0, the transport's reason."""
        return cls(method, url, 0, f"unreachable: {root_cause(exc)}")


class BusyError(PackratError):
    """One at a time: a swap (or profiling job) is running; try again when it is done."""


class ServerError(PackratError):
    """Starting a TorchServe process (packrat.server) failed; the message carries its log tail."""


class SwapError(PackratError):
    """A swap failed; `record` is its history entry (outcome rolled_back or failed) when it got that far."""

    def __init__(self, message: str, record: SwapRecord | None = None) -> None:
        super().__init__(message)
        self.record = record


class ModeRefusedError(SwapError):
    """The new version's workers refused to load its execution mode (its accuracy guard, or a
    precision this CPU lacks): the request's fault, answered 422 like a mode refused up front."""
