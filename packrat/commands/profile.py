"""`packrat profile`: measure L(t, b) of one archive on this machine and save it."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import typer

from packrat.commands._options import setting_option
from packrat.errors import ArchiveError, ConfigError, PackratError
from packrat.types import Profile


@contextlib.contextmanager
def _archive_for(path: Path) -> Iterator:
    """An archive to profile: `path` itself, or a temporary archive of a HF model directory.

    A plain Hugging Face directory (config.json, no packrat_handler.py) is packed
    with `packrat archive`'s defaults under its directory name, so its model id
    equals that of `packrat archive <dir>` with default options.
    """
    from packrat.profile import open_archive

    if path.is_dir() and not (path / "packrat_handler.py").exists() and (path / "config.json").is_file():
        from packrat.archive import ArchiveOptions, build_from_dir

        with tempfile.TemporaryDirectory(prefix="packrat-profile-store-") as store:
            yield open_archive(build_from_dir(path, Path(store), path.resolve().name, ArchiveOptions()))
    else:
        yield open_archive(path)


def _table(profile: Profile) -> str:
    threads = sorted({p.threads for p in profile.points})
    batches = sorted({p.batch for p in profile.points})
    lines = ["mean ms   " + "".join(f"{f'b={b}':>10}" for b in batches)]
    for t in threads:
        cells = []
        for b in batches:
            ms = profile.latency(t, b)
            cells.append(f"{ms:10.1f}" if ms is not None else f"{'-':>10}")
        lines.append(f"t={t:<8}" + "".join(cells))
    return "\n".join(lines)


def profile_command(
    path: Path = typer.Argument(
        ..., help="Archive directory (with packrat_handler.py), .mar file, or Hugging Face model directory"
    ),
    output: Optional[Path] = typer.Option(
        None, "-o", "--output",
        help="Profile JSON to write [default: <state dir>/profiles/<model>/<mode>.json, where the "
             "controller and `packrat tune` find it; scope model: <mode>-model.json]"
    ),
    mode: Optional[str] = typer.Option(
        None, "--mode", help="Profile the archive in this execution mode, e.g. bf16-openvino "
                             "[default: the archive's own] (docs/modes.md)"),
    state_dir: Optional[Path] = setting_option("state_dir", text="where the default output goes"),
    cores: Optional[int] = typer.Option(None, "--cores", help="T: profile thread counts 1..T [default: all usable cores]"),
    max_batch: int = setting_option("profile_max_batch", "--max-batch"),
    budget: Optional[float] = typer.Option(None, "--budget", help="Total seconds for the whole run (default: none)"),
    point_budget: float = setting_option("profile_point_budget_s", "--point-budget"),
    scope: str = typer.Option("handler", "--scope", help="handler: pre+forward+post; model: forward only"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table"),
    corun: bool = typer.Option(True, "--corun/--no-corun",
                               help="Also time <T//t, t> shapes with all instances at once (co-run figures)"),
) -> None:
    """Time one isolated, pinned instance at t = 1..T threads and b = 1, 2, 4, ... batch, then
    the uniform shapes with every instance running at once (co-run)."""
    from packrat.cores import usable_cores
    from packrat.profile import ProfileSettings

    try:
        usable = len(usable_cores().cores)
        settings = ProfileSettings(
            cores=cores if cores is not None else usable,
            max_batch=max_batch,
            budget_s=budget,
            point_budget_s=point_budget,
            scope=scope,
            corun=corun,
        )
        settings.validate(usable)  # before any archive is built or read
        if output is not None and output.is_dir():
            raise ConfigError(f"{output}: is a directory; give a file name with -o")
        with _archive_for(path) as archive:
            if mode:
                from packrat.profile.fingerprint import split_mode
                from packrat.profile.identity import archive_in_mode

                try:
                    split_mode(mode)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
                archive = archive_in_mode(archive, mode)
            out = output or _default_output(state_dir, archive, scope)
            profile = _run(archive, settings, out, quiet)
    except (ConfigError, ArchiveError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except PackratError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("interrupted; points measured so far are in the output file (complete: false)", err=True)
        raise typer.Exit(130) from None

    if not quiet:
        typer.echo(_table(profile))
    from packrat.profile.runner import contention_warning

    warning = contention_warning(profile)
    if warning:
        typer.echo(warning, err=True)
    omitted = profile.extra.get("omitted", [])
    typer.echo(
        f"wrote {out}: {len(profile.points)} points, {len(omitted)} omitted, "
        f"{profile.extra.get('duration_s')} s"
    )


def _default_output(state_dir: Path | None, archive, scope: str) -> Path:
    from packrat import settings
    from packrat.profile.fingerprint import mode_from_config
    from packrat.profile.library import profile_file

    mode = mode_from_config(archive.config)
    # --state-dir > $PACKRAT_STATE_DIR > .packrat, as the controller finds it.
    out = profile_file(settings.value("state_dir", cli=state_dir), archive.model_name, mode)
    return out if scope == "handler" else out.with_name(f"{mode}-{scope}.json")


def _run(archive, settings, out: Path, quiet: bool) -> Profile:
    from packrat.profile import run_profile, save_profile

    if not quiet:
        typer.echo(f"profiling {archive.model_name} ({archive.model_id[:19]}), scope={settings.scope} -> {out}", err=True)
    profile = run_profile(
        archive,
        settings,
        progress=not quiet,
        on_update=lambda partial: save_profile(partial, out),  # saved the moment a point lands
        log_path=out.with_suffix(".log"),
    )
    save_profile(profile, out)
    return profile


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_command)
