"""CLI command groups, one module per stage. Each module defines register(app);
a module whose name starts with "_" is a helper, not a command group."""

from __future__ import annotations

from collections.abc import Callable

import typer

REGISTRARS: list[Callable[[typer.Typer], None]] = []


def _collect() -> None:
    import importlib
    import pkgutil

    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        REGISTRARS.append(module.register)


_collect()
