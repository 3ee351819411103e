"""Isolated single-instance timing runs and profile files.

Nothing here imports torch, numpy or scipy at import time: the worker
(`python -m packrat.profile.worker`) imports this package before it pins
itself, and the pools those libraries start must be born on the pinned cores.
"""

from packrat.profile.fingerprint import current_fingerprint
from packrat.profile.identity import ArchiveRef, content_hash, open_archive
from packrat.profile.runner import ProfileSettings, batch_sizes, run_profile
from packrat.profile.store import (
    FORMAT,
    check_profile,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)

__all__ = [
    "FORMAT",
    "ArchiveRef",
    "ProfileSettings",
    "batch_sizes",
    "check_profile",
    "content_hash",
    "current_fingerprint",
    "load_profile",
    "open_archive",
    "profile_from_dict",
    "profile_to_dict",
    "run_profile",
    "save_profile",
]
