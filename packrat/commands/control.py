"""`packrat controller` (attach to a running TorchServe) and `packrat serve` (start both)."""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from packrat import settings
from packrat.commands._options import setting_option
from packrat.errors import ConfigError, PackratError

if TYPE_CHECKING:  # loaded when a command runs, not when the CLI starts
    from packrat.control import Controller
    from packrat.server import RunningServer

# The table's text describes the default; as a flag, the option says what it sets.
TUNE_BATCH_HELP = "load batch B to tune for; unset: the observed B, else the default"


@dataclass(frozen=True)
class LoopOptions:
    """The re-plan loop's and the automatic tune's options (None: that part's own default)."""

    adapt: bool = True
    min_dwell_s: float | None = None
    tune: bool = True
    tune_modes: list[str] | None = None
    tune_budget_s: float | None = None
    tune_batch: int | None = None
    tune_max_batch: int | None = None
    tune_point_budget_s: float | None = None
    tune_again_quiet_s: float = 0.0  # a busy tune measured again after this long quiet (0: never)
    tune_check_s: float = 10.0  # between the auto-tuner's (or the re-profiler's) checks of every model


@dataclass(frozen=True)
class RunOptions:
    """What `controller` and `serve` both take: the store, where state goes, the cores, the
    API's address and the loop. TorchServe's addresses and key file differ between them."""

    model_store: Path
    state_dir: Path
    cores: tuple[int, ...] | None
    host: str
    port: int
    loop: LoopOptions = LoopOptions()


# The flags of RunOptions, which both commands end with: parameter -> (type, option).
# Unset, the loop's and the tune's own defaults apply (the table's, shown in brackets).
RUN_FLAGS: dict[str, tuple[Any, Any]] = {
    "model_store": (Path, setting_option("model_store")),
    "state_dir": (Optional[Path], setting_option("state_dir")),
    "cores": (Optional[str], setting_option("cores")),
    "host": (str, setting_option("api_host")),
    "port": (int, setting_option("api_port")),
    "adapt": (bool, typer.Option(True, "--adapt/--no-adapt", help="re-plan automatically when the load moves")),
    "min_dwell": (Optional[float], setting_option("min_dwell_s", deferred=True)),
    "tune": (bool, typer.Option(True, "--tune/--no-tune",
                                help="tune every Packrat model (execution mode and shape) in the background")),
    "tune_modes": (list[str], typer.Option([], "--tune-mode", help="modes the automatic tune tries besides the "
                                           "archive's own (repeat; 'all') (default: a short list per task)")),
    "tune_budget": (Optional[float], setting_option("tune_budget_s", deferred=True)),
    "tune_batch": (Optional[int], setting_option("tune_batch", deferred=True, text=TUNE_BATCH_HELP)),
    "tune_max_batch": (Optional[int], setting_option("tune_max_batch", deferred=True)),
    "tune_point_budget": (Optional[float], setting_option("tune_point_budget_s", deferred=True)),
}


def _run_options(flags: dict[str, Any]) -> RunOptions:
    """RUN_FLAGS' values, parsed: --state-dir > $PACKRAT_STATE_DIR > .packrat, --cores as a CPU list."""
    loop = LoopOptions(adapt=flags["adapt"], min_dwell_s=flags["min_dwell"], tune=flags["tune"],
                       tune_modes=flags["tune_modes"] or None,  # no --tune-mode: the tune's own list
                       tune_budget_s=flags["tune_budget"], tune_batch=flags["tune_batch"],
                       tune_max_batch=flags["tune_max_batch"], tune_point_budget_s=flags["tune_point_budget"],
                       tune_again_quiet_s=_setting("tune_again_quiet_s"), tune_check_s=_check_s())
    return RunOptions(model_store=flags["model_store"],
                      state_dir=settings.value("state_dir", cli=flags["state_dir"]),
                      cores=_parse_cores(flags["cores"]), host=flags["host"], port=flags["port"], loop=loop)


def with_run_flags(command: Callable[..., None]) -> Callable[..., None]:
    """`command(..., run: RunOptions)` as a typer command whose flags end with RUN_FLAGS.

    typer reads a command's flags from its signature: this one is the command's own
    parameters and then RUN_FLAGS, whose values reach the command as one RunOptions.
    """
    own = [p for p in inspect.signature(command).parameters.values() if p.name != "run"]
    flags = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
             for name, (kind, option) in RUN_FLAGS.items()]

    @functools.wraps(command)
    def parsed(**kw: Any) -> None:
        command(**{k: v for k, v in kw.items() if k not in RUN_FLAGS}, run=_run_options(kw))

    parsed.__signature__ = inspect.Signature(own + flags)  # type: ignore[attr-defined]
    return parsed


def _setting(name: str) -> Any:
    """settings.value(name): a variable that does not parse is a usage error, not a traceback."""
    try:
        return settings.value(name)
    except settings.SettingError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _check_s() -> float:
    value = _setting("tune_check_s")
    if value <= 0:
        raise typer.BadParameter(f"PACKRAT_TUNE_CHECK_S must be > 0 seconds, got {value:g}")
    return value


def _parse_cores(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    from packrat.slots import parse_cpu_list

    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise typer.BadParameter(f"--cores wants a CPU list like 0-3 or 0,2: {text!r}") from exc


def _loopback(host: str) -> str:
    """The address the TorchServe plugin reaches a controller bound to `host` at (it forwards on loopback only)."""
    if host in ("0.0.0.0", "", "localhost"):
        return "127.0.0.1"
    if host in ("::", "::1"):
        return "[::1]"
    return host


def run_controller(*, management_url: str, metrics_url: str | None, key_file: Path, run: RunOptions,
                   stop: threading.Event | None = None) -> None:
    """Attach, clean up after a killed predecessor, then serve the REST API until stopped."""
    from packrat.control import Controller, ControllerSettings

    _log_actions()
    controller_settings = ControllerSettings(
        management_url=management_url,
        metrics_url=metrics_url,
        key_file=key_file,
        model_store=run.model_store,
        state_dir=run.state_dir,
        cores=run.cores,
        # The re-plan loop's estimator counts ticks of about a second.
        tick_s=1.0 if run.loop.adapt else 5.0,
    )
    policy = None
    if run.loop.adapt:
        from packrat.observe.loop import AdaptiveLoop, adapt_settings, log_decisions_to

        policy = AdaptiveLoop(adapt_settings(min_dwell_s=run.loop.min_dwell_s))
        log_decisions_to(run.state_dir / "decisions.jsonl")
    controller = Controller(controller_settings, policy=policy)
    controller.acquire()
    try:
        # Bound before anything is attached or started: a taken port used to end the
        # controller only after it had re-applied plans and started a tune (uvicorn binds last).
        api_socket = bind_api(run.host, run.port)
        _attach(controller)
        stop = stop or threading.Event()
        ticker = threading.Thread(target=controller.run, args=(stop,), name="controller-tick", daemon=True)
        ticker.start()
        if run.loop.tune:
            _start_tuner(controller, run.loop, stop)
        else:  # the plan still follows the traffic's input shape: re-profile on a shift
            from packrat.control.tuning import Reprofiler

            reprofiler = Reprofiler(controller, interval_s=run.loop.tune_check_s)
            threading.Thread(target=reprofiler.run, args=(stop,), name="controller-reprofile", daemon=True).start()
        _serve_api(controller, api_socket, stop)
    finally:
        controller.release()


# The loggers of what the controller does on its own (not packrat.adapt: the re-plan loop's
# decisions, one a tick, have their own file, decisions.jsonl).
ACTION_LOGGERS = ("packrat.controller", "packrat.autotune", "packrat.tune", "packrat.apply")


def _log_actions() -> None:
    """What the controller does on its own, on stderr at INFO: a tune or re-profile started,
    a kept profile planned from, cores divided among models, a model moved to the shared
    core. Without a handler only warnings reached the terminal, bare. Once per process."""
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ACTION_LOGGERS:
        log = logging.getLogger(name)
        if any(getattr(h, "packrat_actions", False) for h in log.handlers):
            continue
        handler = logging.StreamHandler()
        handler.setFormatter(formatter)
        handler.packrat_actions = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        if log.level == logging.NOTSET or log.level > logging.INFO:
            log.setLevel(logging.INFO)


def _start_tuner(controller: Controller, loop: LoopOptions, stop: threading.Event) -> None:
    """Every Packrat model to its fastest measured (mode, shape), in the background."""
    from packrat.control.tuning import AutoTuner

    tuner = AutoTuner(controller, modes=loop.tune_modes, budget_s=loop.tune_budget_s, batch=loop.tune_batch,
                      max_batch=loop.tune_max_batch, point_budget_s=loop.tune_point_budget_s,
                      again_quiet_s=loop.tune_again_quiet_s, interval_s=loop.tune_check_s)
    threading.Thread(target=tuner.run, args=(stop,), name="controller-autotune", daemon=True).start()
    typer.echo("tuning every Packrat model in the background (--no-tune to switch off); "
               "progress: packrat status", err=True)


def _attach(controller: Controller) -> None:
    """Attach to TorchServe (finishing or undoing a swap a killed controller left) and say what runs."""
    cleaned = controller.attach()
    for c in cleaned:
        typer.echo(f"attach: {c}", err=True)
    for m in controller.models():
        try:
            st = controller.model_state(m)
        except PackratError as exc:  # one model's broken files: say so, serve the others (issue 31)
            typer.echo(f"{m}: broken, left as it is: {exc}", err=True)
            continue
        shape = (
            " + ".join(f"{i.threads}t/b{i.batch}" for i in st.plan.instances) if st.plan else "not a Packrat plan"
        )
        typer.echo(f"{m}: version {st.version} ({shape})", err=True)


def bind_api(host: str, port: int) -> socket.socket:
    """The API's socket (packrat.server.bind_reusing); ConfigError naming the port and the
    option to change it when it cannot be bound."""
    from packrat.server import bind_reusing

    try:
        return bind_reusing(host, port)
    except OSError as exc:
        taken = " (another controller, or another server, listens there)" if exc.errno == errno.EADDRINUSE else ""
        raise ConfigError(f"the controller's API cannot listen on {host}:{port}: {exc.strerror}{taken}; "
                          f"choose another port with --port (PACKRAT_API_PORT in a pod)") from None


def _serve_api(controller: Controller, sock: socket.socket, stop: threading.Event) -> None:
    """The REST API on `sock` until `stop` is set (or uvicorn stops on a signal, which then sets it)."""
    from packrat.api import create_app
    from packrat.api.server import QuietServer, api_config

    host, port = sock.getsockname()[:2]
    server = QuietServer(api_config(create_app(controller), host, port))  # uvicorn's housekeeping once a second, not ten times
    typer.echo(f"packrat controller API on http://{_url_host(host)}:{port} (token: TorchServe management key)",
               err=True)

    def watch() -> None:
        stop.wait()
        server.should_exit = True

    threading.Thread(target=watch, daemon=True).start()
    server.run(sockets=[sock])
    stop.set()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@with_run_flags
def controller_command(
    management_url: str = setting_option("management_url"),
    metrics_url: Optional[str] = setting_option("metrics_url"),
    key_file: Path = typer.Option(Path("key_file.json"), "--key-file", help="TorchServe's key_file.json"),
    restart_on_crash: bool = typer.Option(
        False, "--restart-on-crash", help="run the controller as a child process and start it again when it "
        "crashes (killed by a signal, or a non-zero exit after 10 s; backing off 1 s to 60 s)"),
    *,
    run: RunOptions,
) -> None:
    """Attach to a running TorchServe and serve the Packrat REST API."""
    if restart_on_crash:
        from packrat.control.supervise import supervise

        # The same command line without the flag, in a child (python -m packrat.cli works as `packrat`).
        raise typer.Exit(supervise([sys.executable, "-m", "packrat.cli",
                                    *[a for a in sys.argv[1:] if a != "--restart-on-crash"]]))
    try:
        run_controller(management_url=management_url, metrics_url=metrics_url, key_file=key_file, run=run)
    except PackratError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


@with_run_flags
def serve_command(
    config: Path = setting_option("ts_config"),
    models: list[str] = typer.Option([], "--model", help="model dir in the store to load at start (repeat)"),
    *,
    run: RunOptions,
) -> None:
    """Start TorchServe (with the config's ports) and the controller; Ctrl-C stops both."""
    server = _start_torchserve(config, models, run)
    stop = threading.Event()
    for sig in (signal.SIGTERM,):
        signal.signal(sig, lambda *_: stop.set())
    try:
        run_controller(management_url=server.management_url, metrics_url=server.metrics_url,
                       key_file=server.key_file, run=run, stop=stop)
    except PackratError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    finally:
        typer.echo("stopping TorchServe", err=True)
        server.stop()


def _start_torchserve(config: Path, models: list[str], run: RunOptions) -> RunningServer:
    """TorchServe for `packrat serve`, its plugin pointed at this controller; exit 1 if it does not start."""
    from packrat.server import Ports, read_properties, start_torchserve

    try:
        server = start_torchserve(
            run.model_store,
            run.state_dir / "torchserve",
            config_template=config,
            ports=Ports.fixed_from(read_properties(config)),
            models=models or None,
            # The plugin's /packrat/... on the management port forwards to this controller.
            extra_properties={"packrat_controller_url": f"http://{_loopback(run.host)}:{run.port}"},
        )
    except PackratError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(
        f"TorchServe: inference {server.inference_url}, management {server.management_url}, "
        f"metrics {server.metrics_url}; keys in {server.key_file}",
        err=True,
    )
    return server


def register(app: typer.Typer) -> None:
    app.command("controller")(controller_command)
    app.command("serve")(serve_command)
