"""`packrat controller` (attach to a running TorchServe) and `packrat serve` (start both)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from packrat.errors import PackratError

DEFAULT_API_PORT = 8085

# The re-plan loop's and the tuner's options, shared by `controller` and `serve`.
ADAPT = typer.Option(True, "--adapt/--no-adapt", help="re-plan automatically when the load moves")
MIN_DWELL = typer.Option(None, "--min-dwell", help="seconds between automatic swaps [60]")
TUNE = typer.Option(True, "--tune/--no-tune",
                    help="tune every Packrat model (execution mode and shape) in the background")
TUNE_MODES = typer.Option([], "--tune-mode", help="modes the automatic tune tries besides the "
                          "archive's own (repeat; 'all') (default: a short list per task)")
TUNE_BUDGET = typer.Option(None, "--tune-budget", help="seconds per model tune [180]")
TUNE_BATCH = typer.Option(None, "--tune-batch", help="load batch B to tune for (default: observed, else 8)")
TUNE_MAX_BATCH = typer.Option(None, "--tune-max-batch", help="largest profiled batch (default: max(B, 8))")
TUNE_POINT_BUDGET = typer.Option(None, "--tune-point-budget", help="seconds per profiled point [5]")


def _loop_options(adapt: bool, min_dwell: float | None, tune: bool, tune_modes: list[str],
                  tune_budget: float | None, tune_batch: int | None, tune_max_batch: int | None,
                  tune_point_budget: float | None) -> dict:
    """The CLI's loop and tune options as run_controller's keyword arguments."""
    return dict(adapt=adapt, min_dwell_s=min_dwell, tune=tune, tune_modes=tune_modes or None,
                tune_budget_s=tune_budget, tune_batch=tune_batch, tune_max_batch=tune_max_batch,
                tune_point_budget_s=tune_point_budget)


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


def run_controller(
    *,
    management_url: str,
    metrics_url: str | None,
    key_file: Path,
    model_store: Path,
    state_dir: Path,
    cores: tuple[int, ...] | None,
    host: str,
    port: int,
    stop: threading.Event | None = None,
    adapt: bool = True,
    min_dwell_s: float | None = None,
    tune: bool = True,
    tune_modes: list[str] | None = None,
    tune_budget_s: float | None = None,
    tune_batch: int | None = None,
    tune_max_batch: int | None = None,
    tune_point_budget_s: float | None = None,
) -> None:
    """Attach, clean up after a killed predecessor, then serve the REST API until stopped."""
    import uvicorn

    from packrat.api import create_app
    from packrat.control import Controller, ControllerSettings

    settings = ControllerSettings(
        management_url=management_url,
        metrics_url=metrics_url,
        key_file=key_file,
        model_store=model_store,
        state_dir=state_dir,
        cores=cores,
        # The re-plan loop's estimator counts ticks of about a second.
        tick_s=1.0 if adapt else 5.0,
    )
    policy = None
    if adapt:
        from packrat.observe.loop import AdaptiveLoop, adapt_settings, log_decisions_to

        policy = AdaptiveLoop(adapt_settings(min_dwell_s=min_dwell_s))
        log_decisions_to(state_dir / "decisions.jsonl")
    controller = Controller(settings, policy=policy)
    controller.acquire()
    try:
        cleaned = controller.attach()
        for c in cleaned:
            typer.echo(f"cleaned up after an interrupted swap: {c}", err=True)
        for m in controller.models():
            st = controller.model_state(m)
            shape = (
                " + ".join(f"{i.threads}t/b{i.batch}" for i in st.plan.instances) if st.plan else "not a Packrat plan"
            )
            typer.echo(f"{m}: version {st.version} ({shape})", err=True)
        stop = stop or threading.Event()
        ticker = threading.Thread(target=controller.run, args=(stop,), name="controller-tick", daemon=True)
        ticker.start()
        if tune:
            # Every Packrat model to its fastest measured (mode, shape), in the background.
            from packrat.control.tuning import AutoTuner

            tuner = AutoTuner(controller, modes=tune_modes, budget_s=tune_budget_s, batch=tune_batch,
                              max_batch=tune_max_batch, point_budget_s=tune_point_budget_s)
            threading.Thread(target=tuner.run, args=(stop,), name="controller-autotune", daemon=True).start()
            typer.echo("tuning every Packrat model in the background (--no-tune to switch off); "
                       "progress: packrat status", err=True)
        config = uvicorn.Config(create_app(controller), host=host, port=port, log_level="warning")
        server = uvicorn.Server(config)
        typer.echo(f"packrat controller API on http://{host}:{port} (token: TorchServe management key)", err=True)

        def watch() -> None:
            stop.wait()
            server.should_exit = True

        threading.Thread(target=watch, daemon=True).start()
        server.run()
        stop.set()
    finally:
        controller.release()


def register(app: typer.Typer) -> None:
    @app.command("controller")
    def controller_command(
        management_url: str = typer.Option("http://127.0.0.1:8081", "--management-url"),
        metrics_url: Optional[str] = typer.Option("http://127.0.0.1:8082", "--metrics-url"),
        key_file: Path = typer.Option(Path("key_file.json"), "--key-file", help="TorchServe's key_file.json"),
        model_store: Path = typer.Option(Path("model-store"), "--model-store"),
        state_dir: Path = typer.Option(Path(".packrat"), "--state-dir"),
        cores: Optional[str] = typer.Option(None, "--cores", help="usable cores, e.g. 0-3 [default: affinity]"),
        host: str = typer.Option("127.0.0.1", "--host", help="REST API address (loopback by default)"),
        port: int = typer.Option(DEFAULT_API_PORT, "--port", help="REST API port"),
        adapt: bool = ADAPT,
        min_dwell: Optional[float] = MIN_DWELL,
        tune: bool = TUNE,
        tune_modes: list[str] = TUNE_MODES,
        tune_budget: Optional[float] = TUNE_BUDGET,
        tune_batch: Optional[int] = TUNE_BATCH,
        tune_max_batch: Optional[int] = TUNE_MAX_BATCH,
        tune_point_budget: Optional[float] = TUNE_POINT_BUDGET,
    ) -> None:
        """Attach to a running TorchServe and serve the Packrat REST API."""
        try:
            run_controller(
                management_url=management_url,
                metrics_url=metrics_url,
                key_file=key_file,
                model_store=model_store,
                state_dir=state_dir,
                cores=_parse_cores(cores),
                host=host,
                port=port,
                **_loop_options(adapt, min_dwell, tune, tune_modes, tune_budget, tune_batch, tune_max_batch,
                                tune_point_budget),
            )
        except PackratError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc

    @app.command("serve")
    def serve_command(
        config: Path = typer.Option(Path("config.properties"), "--config", help="TorchServe config.properties"),
        model_store: Path = typer.Option(Path("model-store"), "--model-store"),
        models: list[str] = typer.Option([], "--model", help="model dir in the store to load at start (repeat)"),
        state_dir: Path = typer.Option(Path(".packrat"), "--state-dir"),
        cores: Optional[str] = typer.Option(None, "--cores"),
        host: str = typer.Option("127.0.0.1", "--host"),
        port: int = typer.Option(DEFAULT_API_PORT, "--port"),
        adapt: bool = ADAPT,
        min_dwell: Optional[float] = MIN_DWELL,
        tune: bool = TUNE,
        tune_modes: list[str] = TUNE_MODES,
        tune_budget: Optional[float] = TUNE_BUDGET,
        tune_batch: Optional[int] = TUNE_BATCH,
        tune_max_batch: Optional[int] = TUNE_MAX_BATCH,
        tune_point_budget: Optional[float] = TUNE_POINT_BUDGET,
    ) -> None:
        """Start TorchServe (with the config's ports) and the controller; Ctrl-C stops both."""
        from packrat.server import Ports, read_properties, start_torchserve

        try:
            server = start_torchserve(
                model_store,
                state_dir / "torchserve",
                config_template=config,
                ports=Ports.fixed_from(read_properties(config)),
                models=models or None,
                # The plugin's /packrat/... on the management port forwards to this controller.
                extra_properties={"packrat_controller_url": f"http://{_loopback(host)}:{port}"},
            )
        except PackratError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
        typer.echo(
            f"TorchServe: inference {server.inference_url}, management {server.management_url}, "
            f"metrics {server.metrics_url}; keys in {server.workdir / 'key_file.json'}",
            err=True,
        )
        stop = threading.Event()
        for sig in (signal.SIGTERM,):
            signal.signal(sig, lambda *_: stop.set())
        try:
            run_controller(
                management_url=server.management_url,
                metrics_url=server.metrics_url,
                key_file=server.workdir / "key_file.json",
                model_store=model_store,
                state_dir=state_dir,
                cores=_parse_cores(cores),
                host=host,
                port=port,
                stop=stop,
                **_loop_options(adapt, min_dwell, tune, tune_modes, tune_budget, tune_batch, tune_max_batch,
                                tune_point_budget),
            )
        except PackratError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
        finally:
            typer.echo("stopping TorchServe", err=True)
            server.stop()
