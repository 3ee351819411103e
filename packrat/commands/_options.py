"""CLI options whose default and help text come from the settings table (packrat.settings).

A default is written once, in the table (docs/settings.md is generated from it);
`--help` shows it in brackets from there, so a changed default cannot leave a help
text behind.
"""

from __future__ import annotations

from typing import Any

import typer

from packrat import settings


def setting_option(name: str, *flags: str, text: str | None = None, deferred: bool = False, **kw: Any) -> Any:
    """A typer option for the table's setting `name`.

    Flags: `flags`, else the table's first. Help: `text`, else the table's.
    Default: the table's (typer shows it), except None when the setting has an
    environment variable or is `deferred`: the command then resolves it, with
    settings.value(name, cli=...) (CLI > environment > default), or leaves it to the
    part that owns the default (a tune's budget: packrat.tune); the help then shows
    the table's default in brackets, and the variable.
    """
    setting = settings.get(name)
    if deferred or setting.env:
        default = None
        help_text = settings.help_for(name, text) + (f" (${setting.env})" if setting.env else "")
    else:
        default = setting.default
        help_text = text if text is not None else setting.help
    return typer.Option(default, *(flags or setting.options[:1]), help=help_text, **kw)
