"""All Packrat exceptions.

    PackratError
    ├── ConfigError          bad settings, CLI arguments or plan input
    ├── ProfileError         a profile file is missing, malformed or unusable
    │   └── ProfileMismatchError   measured on another machine/model/mode
    ├── PlanError            no feasible plan for the given cores and batch
    ├── ArchiveError         building a model archive failed
    ├── TorchServeError      TorchServe's REST API answered with an error
    └── SwapError            applying a plan failed (and was rolled back)
"""

from __future__ import annotations


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


class TorchServeError(PackratError):
    """An error answer from TorchServe's REST API (translated only in packrat.apply)."""

    def __init__(self, method: str, url: str, status: int, body: str) -> None:
        self.method = method
        self.url = url
        self.status = status
        self.body = body
        super().__init__(f"{method} {url} -> HTTP {status}: {body[:500]}")


class SwapError(PackratError):
    pass
