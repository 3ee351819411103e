"""`packrat torchserve start|stop|register|curl`: one TorchServe in a work directory.

Used by `make run` / `make stop` (scripts/run_demo.sh, scripts/stop_demo.sh).
The server runs detached in its own process group; its state (pid, ports)
lives in <workdir>/server.json, its keys in <workdir>/key_file.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from packrat.commands._options import setting_option
from packrat.errors import PackratError

ts_app = typer.Typer(no_args_is_help=True, add_completion=False,
                     help="Start, stop and use a TorchServe instance kept in a work directory.")

WORKDIR = setting_option("ts_workdir")
_START_ONE = "start one (make run, packrat torchserve start)"


def _attached(workdir: Path):  # -> packrat.server.RunningServer (imported late: CLI start-up)
    """The running server recorded in `workdir`, or a clear error and exit 2: the commands
    that need one must not end in a traceback when there is none."""
    from packrat.server import RunningServer

    try:
        server = RunningServer.attach(workdir)
    except (OSError, ValueError, KeyError) as exc:
        why = "" if isinstance(exc, FileNotFoundError) else f" ({workdir / 'server.json'}: {exc})"
        typer.echo(f"error: no TorchServe recorded in {workdir}{why}: {_START_ONE}", err=True)
        raise typer.Exit(2) from None
    if not server.is_running():
        typer.echo(f"error: the TorchServe recorded in {workdir} (pid {server.pid}) is not running: {_START_ONE}",
                   err=True)
        raise typer.Exit(2)
    return server


@ts_app.command("start")
def start(
    workdir: Path = WORKDIR,
    model_store: Path = setting_option("model_store"),
    config: Path = setting_option("ts_config"),
    free_ports: bool = typer.Option(False, "--free-ports", help="Free ports instead of the config's"),
    controller_url: Optional[str] = typer.Option(
        None, "--controller-url", help="where the endpoint plugin forwards /packrat/... (the config's "
        "packrat_controller_url, else http://127.0.0.1:8085): the controller's --port, on loopback"),
    models: Optional[list[str]] = typer.Option(
        None, "--models", help="archive names in the model store to load at start (repeat the option); "
        "a frontend that crashes is started again with them"),
) -> None:
    """Start TorchServe detached; returns once /ping is healthy."""
    from packrat.server import Ports, RunningServer, read_properties, start_torchserve

    if (workdir / "server.json").exists():
        try:
            old = RunningServer.attach(workdir)
        except (OSError, ValueError, KeyError):
            old = None  # an unreadable record names no server: start writes a new one
        if old is not None and old.is_running():
            typer.echo(f"TorchServe already running (pid {old.pid}) at {old.inference_url}")
            return
    ports = None if free_ports else Ports.fixed_from(read_properties(config))
    extra = {"packrat_controller_url": controller_url} if controller_url else None
    try:
        server = start_torchserve(model_store, workdir, config_template=config, ports=ports, extra_properties=extra,
                                  models=models or None)
    except PackratError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"TorchServe pid {server.pid}: inference {server.inference_url}, "
               f"management {server.management_url}, metrics {server.metrics_url}")


@ts_app.command("stop")
def stop(workdir: Path = WORKDIR) -> None:
    """Stop the TorchServe of this work directory and all its workers."""
    from packrat.server import RunningServer

    if not (workdir / "server.json").exists():
        typer.echo("no TorchServe recorded in " + str(workdir))
        return
    server = RunningServer.attach(workdir)
    server.stop()
    typer.echo(f"TorchServe pid {server.pid} stopped")


@ts_app.command("register")
def register_models(
    names: list[str] = typer.Argument(..., help="Archive directory names in the model store"),
    workdir: Path = WORKDIR,
    workers: int = typer.Option(1, help="initial workers per model"),
) -> None:
    """Register archives by name; returns when their workers are READY. One already registered
    (loaded at start with --models) is waited for until a worker of it is READY."""
    from concurrent.futures import ThreadPoolExecutor

    server = _attached(workdir)
    try:
        loaded = {m["modelName"] for m in server.management_client().list_models()}
    except PackratError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    # In parallel: each worker spends seconds importing torch; TorchServe loads concurrently.
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {name: (pool.submit(server.wait_ready, name, 1) if name in loaded
                          else pool.submit(server.register, name, workers)) for name in names}
        failed = False
        for name, future in futures.items():
            try:
                future.result()
                typer.echo(f"{name}: {'already registered, a worker READY' if name in loaded else 'registered'}")
            except PackratError as exc:
                typer.echo(f"error: {name}: {exc}", err=True)
                failed = True
    if failed:
        raise typer.Exit(1)


@ts_app.command("keys")
def keys(workdir: Path = WORKDIR, kind: Optional[str] = typer.Argument(None)) -> None:
    """Print the keys (or one of: inference, management, api); an expired one is replaced
    first through TorchServe's token API, so what is printed works."""
    from packrat.apply.client import ManagementClient
    from packrat.apply.keys import KEY_FILE_NAME, read_keys
    from packrat.server import RunningServer

    if kind not in (None, "inference", "management", "api"):
        raise typer.BadParameter(f"{kind!r} is not one of: inference, management, api", param_hint="KIND")
    key_file = workdir / KEY_FILE_NAME
    try:
        k = read_keys(key_file)
    except PackratError as exc:
        hint = "" if key_file.exists() else f"; TorchServe writes it when it starts: {_START_ONE}"
        typer.echo(f"error: {exc}{hint}", err=True)
        raise typer.Exit(2) from None
    stale = [w for w in ("inference", "management") if kind in (None, w) and getattr(k, w).expired()]
    if stale:  # TorchServe 0.12 does not renew them itself (token_expiration_min, 60 by default)
        try:
            client = ManagementClient(RunningServer.attach(workdir).management_url, key_file)
            for which in stale:
                k = client.refresh_key(which)
        except FileNotFoundError:
            typer.echo(f"error: the {', '.join(stale)} key expired and no TorchServe runs from {workdir} to renew "
                       "it: start one (make run, packrat torchserve start)", err=True)
            raise typer.Exit(1) from None
        except (OSError, PackratError) as exc:
            typer.echo(f"error: the {', '.join(stale)} key expired and could not be renewed: {exc}", err=True)
            raise typer.Exit(1) from None
    if kind:
        typer.echo({"inference": k.inference, "management": k.management, "api": k.api}[kind].key)
        return
    for label, key in (("inference", k.inference), ("management", k.management), ("api", k.api)):
        typer.echo(f"{label:<11} {key.key}  expires {key.expires or 'never'}")


@ts_app.command("url")
def url(which: str = typer.Argument("inference", help="inference | management | metrics"),
        workdir: Path = WORKDIR) -> None:
    """Print one of the server's base URLs."""
    if which not in ("inference", "management", "metrics"):
        raise typer.BadParameter(f"{which!r} is not one of: inference, management, metrics", param_hint="WHICH")
    server = _attached(workdir)
    typer.echo({"inference": server.inference_url, "management": server.management_url,
                "metrics": server.metrics_url}[which])


def register(app: typer.Typer) -> None:
    app.add_typer(ts_app, name="torchserve")
