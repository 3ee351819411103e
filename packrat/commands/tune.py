"""`packrat tune` (ask the controller to tune a model, follow its progress) and
`packrat status` (every model's version, mode, shape, pin and tuning stage).

Both talk to a running `packrat controller` over its REST API
(packrat.commands._client). Defaults match `make run`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import typer

from packrat.commands._client import API, KEY_FILE, call, shape_text
from packrat.commands._options import setting_option
from packrat.types import TuneRecord, ms_text


def mode_table(tune: TuneRecord) -> str:
    """Per mode: what happened to it and its best plan at the tune's batch."""
    lines = [f"  {'mode':<18} {'state':<9} {'predicted ms':>12} {'fat ms':>9}  shape / reason"]
    for mode, m in tune.modes.items():
        row = m.plan
        pred = ms_text(row.predicted_ms) if row is not None and row.predicted_ms is not None else "-"
        fat = ms_text(row.fat_ms) if row is not None and row.fat_ms is not None else "-"
        # the first line of a refusal's reason (none yet while a mode is pending)
        what = ((row.shape or row.reason) if row is not None else None) or next(
            iter((m.reason or "").splitlines()), "")[:100]
        lines.append(f"  {mode:<18} {m.state or '?':<9} {pred:>12} {fat:>9}  {what}")
    for mode, why in tune.skipped.items():
        lines.append(f"  {mode:<18} {'not tried':<9} {'-':>12} {'-':>9}  {why[:100]}")
    return "\n".join(lines)


def tune_command(
    model: str = typer.Argument(..., help="model name as registered in TorchServe"),
    modes: list[str] = typer.Option([], "--mode", help="a mode to try, e.g. bf16-openvino (repeat); 'all' = every "
                                                        "supported mode (default: a short list per task); modes "
                                                        "measured before are compared too unless --fresh"),
    # Unset, the tune's own defaults apply (the settings table's, shown in brackets).
    budget: Optional[float] = setting_option("tune_budget_s", "--budget", deferred=True),
    batch: Optional[int] = setting_option("tune_batch", "--batch", deferred=True,
                                          text="load batch B to choose for; unset: the observed B, else the default"),
    fresh: bool = typer.Option(False, "--fresh", help="re-profile modes whose profile is still valid"),
    max_batch: Optional[int] = setting_option("tune_max_batch", "--max-batch", deferred=True),
    point_budget: Optional[float] = setting_option("tune_point_budget_s", "--point-budget", deferred=True),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="follow the tune until it ends"),
    api: str = API,
    key_file: Path = KEY_FILE,
) -> None:
    """Tune MODEL: guard and profile each execution mode, apply the fastest (mode, plan)."""
    body = {"modes": modes or None, "budget_s": budget, "batch": batch, "fresh": fresh,
            "max_batch": max_batch, "point_budget_s": point_budget}
    job = call("POST", f"{api}/v1/models/{model}/tune", key_file, body)
    typer.echo(f"tune job {job['id']} for {model}: {job['state']}")
    if not wait:
        return
    last = None
    while job["state"] in ("queued", "running"):
        text = (job.get("progress") or {}).get("text") or job["state"]
        if text != last:
            typer.echo(f"  {text}")
            last = text
        time.sleep(1.0)
        job = call("GET", f"{api}/v1/jobs/{job['id']}", key_file)
    final = job.get("result") or job.get("progress") or {}
    typer.echo(mode_table(TuneRecord.from_dict(final)))
    if job["state"] == "done":
        typer.echo(final.get("text", "done"))
    else:
        typer.echo(f"tune failed: {(job.get('error') or '').splitlines()[0] if job.get('error') else ''}", err=True)
        raise typer.Exit(1)


def status_command(
    model: Optional[str] = typer.Argument(None, help="one model (default: every model)"),
    api: str = API,
    key_file: Path = KEY_FILE,
    modes: bool = typer.Option(False, "--modes", help="also the per-mode table of each model's tune"),
) -> None:
    """Every model's live version, execution mode, shape, whether it is pinned, and tuning stage."""
    names = [model] if model else [m["model"] for m in call("GET", f"{api}/v1/models", key_file)]
    for name in names:
        st = call("GET", f"{api}/v1/models/{name}/status", key_file)
        tune = st.get("tune") or {}
        stage = stage_text(st)
        pinned = "pinned" if st.get("pin") else ""
        traffic = traffic_text(st.get("traffic"))
        predicted = predicted_text(st.get("predicted_latency_ms"), st.get("predicted_for"),
                                   (st.get("plan") or {}).get("batch"))
        typer.echo(f"{name:<12} {st['version']:<6} {st.get('mode') or '-':<18} {shape_text(st.get('plan')):<22} "
                   f"{pinned:<7} {stage}" + (f"  [{predicted}]" if predicted else "")
                   + (f"  [{traffic}]" if traffic else ""))
        if modes and tune:
            typer.echo(mode_table(TuneRecord.from_dict(tune)))


def stage_text(status: dict[str, Any]) -> str:
    """The tune's stage, led by the swap of this model under way if there is one, or by the
    last plan the restart watch is to apply again: a tune's "applied X" stays its last word
    while a later swap (a re-apply after a restart, the re-plan loop's, an operator's) is
    still bringing its version up."""
    text = (status.get("tune") or {}).get("text") or "not tuned"
    swap = status.get("swap_in_progress") or {}
    if swap and swap.get("model") == status.get("model"):
        version = f" as version {swap['to_version']}" if swap.get("to_version") else ""
        return (f"swapping to {_target(swap.get('plan'), 'a new plan')}{version} "
                f"({swap.get('phase') or 'starting'}); tune: {text}")
    lost = status.get("lost_plan")
    if lost:  # the restart watch's next swap
        return (f"to apply its last plan again ({_target(lost.get('plan'), 'a Packrat plan')}: version "
                f"{lost.get('version')} is no longer loaded); tune: {text}")
    return text


def _target(plan: dict[str, Any] | None, otherwise: str) -> str:
    """A plan's wire form as "<mode> <shape>" (what it has of them), else `otherwise`."""
    plan = plan or {}
    words = [w for w in (plan.get("mode"), shape_text(plan) if plan.get("instances") else None) if w]
    return " ".join(words) or otherwise


def predicted_text(ms: float | None, sizes: dict[str, Any] | None, batch: int | None = None) -> str:
    """The live plan's prediction, the load batch and the input shape it is for: 'predicted
    65.6 ms at B=4 for tokens 5'. B as in the tune's "predicted ... at B=8": after a re-plan
    (another B, the traffic's sizes) the two figures differ, and each says what it is for."""
    if ms is None:
        return ""
    shape = ", ".join(f"{kind} {size:g}" for kind, size in (sizes or {}).items())
    return (f"predicted {ms_text(ms)} ms" + (f" at B={batch}" if batch else "")
            + (f" for {shape}" if shape else " (input shape not recorded)"))


def traffic_text(traffic: dict[str, Any] | None) -> str:
    """The input shape served, per kind: 'tokens p50 6 p90 115' (status's traffic); '' before any."""
    return ", ".join(f"{kind} p50 {row['p50']:g} p90 {row['p90']:g}" for kind, row in (traffic or {}).items())


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_command)
    app.command("status")(status_command)
