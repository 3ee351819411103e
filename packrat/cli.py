"""The `packrat` command line: each stage registers its own commands."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Packrat for TorchServe")


@app.callback()
def main() -> None:
    """Packrat for TorchServe: profile -> plan -> apply -> observe."""


def _register_all() -> None:
    # One module per stage adds its commands; see each module's register().
    from packrat import commands

    for register in commands.REGISTRARS:
        register(app)


_register_all()

if __name__ == "__main__":
    app()
