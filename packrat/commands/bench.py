"""`packrat bench` (the side-by-side benchmark) and `packrat bench-report` (tables from saved results)."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from packrat import settings
from packrat.errors import ConfigError, PackratError

if TYPE_CHECKING:  # the CLI starts without the bench; its modules load when a bench command runs
    from packrat.bench.run import BenchSettings

TUNE_BUDGET = settings.get("tune_budget_s").default_text()  # a tune's own budget [s], from the table


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--batches must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"--batches must be positive integers, got {text!r}")
    return values


def _configs(text: str) -> tuple[str, ...]:
    from packrat.bench.results import CONFIGS

    chosen = tuple(c.strip() for c in text.split(",") if c.strip())
    unknown = [c for c in chosen if c not in CONFIGS]
    if not chosen or unknown:
        raise ConfigError(f"--configs takes names from {','.join(CONFIGS)}, got {text!r}")
    return chosen


def bench_command(
    model: Optional[list[str]] = typer.Option(
        None, "--model", "-m",
        help="Named architecture (bert-base, gpt2, resnet50, tiny-bert, ...) or archive directory; repeatable"),
    batches: Optional[str] = typer.Option(None, "--batches", "-b", help="Loads B, e.g. 1,2,4,8"),
    quick: bool = typer.Option(False, "--quick", help="Minutes: resnet50 at B = 1,4,8, short profile"),
    full: bool = typer.Option(False, "--full", help="bert-base, gpt2, resnet50 at B = 1..32, tuned (<= 100 min on 2 cores; ~40 min with --no-tuned)"),
    requests: Optional[int] = typer.Option(None, "--requests", "-n",
                                           help="Measured requests per point [default: max(min, rounds x B)]"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output dir [default: bench-out/<time>]"),
    attach: Optional[Path] = typer.Option(None, "--attach", help="Workdir of a running TorchServe to use"),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Use this profile (one model only)"),
    runtime: str = typer.Option("eager", "--runtime", help="Archive runtime: eager | torchscript"),
    batch_delay_ms: Optional[int] = typer.Option(
        None, "--batch-delay-ms", min=0,
        help="maxBatchDelay of every plan [default: Packrat's, a tenth of the predicted batch latency, 5-100 ms]"),
    configs: Optional[str] = typer.Option(
        None, "--configs",
        help="Measure only these of fat,defaults,packrat,oracle,fat-tuned,tuned (default: all; the last two "
             "with tuning only)"),
    tuned: Optional[bool] = typer.Option(
        None, "--tuned/--no-tuned",
        help="Tune each model once (every candidate mode guarded and profiled) and measure fat-tuned and "
             "tuned (default: on with --full, off with --quick; otherwise on when --configs names them)"),
    tune_budget: Optional[float] = typer.Option(
        None, "--tune-budget", min=1.0,
        help=f"Seconds per model's tune (default: 360 with --full, else the tune's {TUNE_BUDGET})"),
    tune_mode: Optional[list[str]] = typer.Option(
        None, "--tune-mode", help="Mode to try besides the archive's own, repeatable (default: the tune's short list)"),
    tune_point_budget: Optional[float] = typer.Option(
        None, "--tune-point-budget", min=0.1, help="Seconds per profiled point in the tune (default: the tune's)"),
    budget_min: Optional[float] = typer.Option(None, "--budget-min", help="Whole-run time bound (minutes)"),
    no_capacity: bool = typer.Option(False, "--no-capacity", help="Skip the load generator's own capacity run"),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
) -> None:
    """Measure fat, TorchServe defaults, packrat, the oracle and (tuned) fat-tuned and tuned side by side
    through a real TorchServe."""
    out = out or Path("bench-out") / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())

    def make_settings() -> BenchSettings:
        if quick and full:
            raise ConfigError("--quick and --full exclude each other")
        kw: dict[str, Any] = dict(requests=requests, attach=attach, profile_path=profile, runtime=runtime,
                                  batch_delay_ms=batch_delay_ms, capacity=not no_capacity, progress=not quiet,
                                  command="packrat bench " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else []))
        kw.update(_chosen(model, batches, configs))
        kw.update(_tuning(kw.get("configs", ()), tuned, tune_budget, tune_mode, tune_point_budget))
        if budget_min is not None:
            kw["budget_s"] = budget_min * 60.0
        chosen = _preset(out, quick, full, kw)
        if profile is not None and len(chosen.models) != 1:
            raise ConfigError("--profile applies to exactly one --model")
        return chosen

    results = _run(out, make_settings)
    typer.echo((out / "summary.md").read_text())
    typer.echo(f"results: {results}  report: {out / 'summary.md'}  chart: {out / 'latency.png'}")


def _chosen(model: list[str] | None, batches: str | None, configs: str | None) -> dict[str, Any]:
    """What to measure: the models, loads and configurations named (the preset's where not)."""
    kw: dict[str, Any] = {}
    if model:
        kw["models"] = tuple(model)
    if batches:
        kw["batches"] = _ints(batches)
    if configs:
        kw["configs"] = _configs(configs)
    return kw


def _tuning(configs: tuple[str, ...], tuned: bool | None, budget: float | None, modes: list[str] | None,
            point_budget: float | None) -> dict[str, Any]:
    """The tune options; naming a tuned configuration switches tuning on."""
    from packrat.bench.tuned import TUNED_CONFIGS

    kw: dict[str, Any] = {}
    named_tuned = any(c in configs for c in TUNED_CONFIGS)
    if tuned is False and named_tuned:
        raise ConfigError(f"--configs names {' / '.join(TUNED_CONFIGS)}, which need tuning: drop --no-tuned")
    if tuned is not None or named_tuned:
        kw["tune"] = bool(tuned) or named_tuned
    if budget is not None:
        kw["tune_budget_s"] = budget
    if modes:
        from packrat.tune import TuneSettings

        TuneSettings(cores=1, modes=tuple(modes)).validate(1)  # an unknown mode fails here, not mid-run
        kw["tune_modes"] = tuple(modes)
    if point_budget is not None:
        kw["tune_point_budget_s"] = point_budget
    return kw


def _preset(out: Path, quick: bool, full: bool, kw: dict[str, Any]) -> BenchSettings:
    from packrat.bench.run import BenchSettings, full_settings, quick_settings

    if quick:
        return quick_settings(out, **kw)
    if full:
        return full_settings(out, **kw)
    if "models" not in kw or "batches" not in kw:
        raise ConfigError("give --model and --batches, or --quick / --full")
    return BenchSettings(out=out, **kw)


def _run(out: Path, make_settings: Callable[[], BenchSettings]) -> Path:
    """Run the bench; on a failure or Ctrl-C, report what was measured before it and exit."""
    from packrat.bench.report import write_report
    from packrat.bench.run import Bench

    try:
        return Bench(make_settings()).run()
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except PackratError as exc:
        typer.echo(f"error: {exc}", err=True)
        if (out / "results.jsonl").exists():
            write_report(out / "results.jsonl")
            typer.echo(f"partial results: {out / 'summary.md'}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        if (out / "results.jsonl").exists():
            write_report(out / "results.jsonl")
            typer.echo(f"interrupted; what was measured is in {out / 'summary.md'}", err=True)
        raise typer.Exit(130) from None


def bench_report_command(
    results: Path = typer.Argument(..., help="results.jsonl written by packrat bench"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Directory [default: beside the results]"),
) -> None:
    """Rebuild summary.md, CSVs and the chart from a saved results.jsonl."""
    from packrat.bench.report import write_report

    if not results.is_file():
        typer.echo(f"error: {results}: no such file", err=True)
        raise typer.Exit(2)
    paths = write_report(results, out)
    typer.echo(paths["summary_md"].read_text())
    typer.echo("  ".join(f"{k}: {v}" for k, v in paths.items()))


def bench_load_command(
    url: str = typer.Argument(..., help="Loopback URL, e.g. http://127.0.0.1:8080/predictions/bert-base"),
    body_file: Optional[Path] = typer.Option(None, "--body", help="File whose bytes are POSTed [default: 'ping']"),
    content_type: str = typer.Option("application/octet-stream", "--content-type"),
    key_file: Optional[Path] = typer.Option(None, "--key-file", help="TorchServe key_file.json (inference key)"),
    clients: int = typer.Option(1, "--clients", "-c", help="Closed loop: concurrent clients (B)"),
    rate: Optional[float] = typer.Option(None, "--rate", help="Open loop: Poisson arrivals per second"),
    requests: int = typer.Option(200, "--requests", "-n", help="Measured requests"),
    warmup: Optional[int] = typer.Option(None, "--warmup"),
) -> None:
    """Drive one endpoint: closed loop with --clients, or open loop (Poisson) with --rate."""
    import json

    from packrat.apply.keys import read_keys
    from packrat.bench.loadgen import Target, closed_loop, open_loop

    try:
        token = read_keys(key_file).inference.key if key_file else None
        body = body_file.read_bytes() if body_file else b"ping"
        target = Target(url, body, content_type, token)
        if rate is not None:
            res = open_loop(target, rate, requests, warmup)
        else:
            res = closed_loop(target, clients, requests, warmup)
    except PackratError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(res.summary(), indent=2))


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)
    app.command("bench-report")(bench_report_command)
    app.command("bench-load")(bench_load_command)
