"""The handler and its task code (handlers/), imported into a benchmark's own process.

The in-process benchmarks time a task exactly as TorchServe's worker runs it, so
they import the handler's modules, which are no part of the packrat package
(they travel inside each model archive). This is the one place a benchmark puts
handlers/ on the import path, as the profiler's worker does with an archive's copy.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from packrat.archive.builder import HANDLER_DIR


def handler_module(name: str) -> ModuleType:
    """handlers/' module `name` ("packrat_handler", "packrat_tasks.text", ...)."""
    if str(HANDLER_DIR) not in sys.path:
        sys.path.insert(0, str(HANDLER_DIR))
    return importlib.import_module(name)
