"""`packrat plan`: the optimiser on a profile file, as a table, JSON or a plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from packrat.errors import PackratError, PlanError
from packrat.types import Plan, Profile

# packrat.plan (numpy) is imported inside run_plan: every `packrat` command
# imports this module, and only `packrat plan` needs the optimiser.


def _positive_int(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise PackratError(f"{flag} must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise PackratError(f"{flag} must be a positive integer, got {value}")
    return value


def _try(fn, *args) -> Plan | str:
    try:
        return fn(*args)
    except PlanError as exc:
        return str(exc)


def _render_table(profile: Profile, shown: Plan, other: Plan | str, realizable: bool,
                  cover: bool) -> str:
    fp = profile.fingerprint
    measured = (f"{fp.cpu_model}, {fp.usable_cores} cores, {fp.allocator}, "
                f"torch {fp.torch_version}, {fp.mode}") if fp else "no fingerprint"
    kind = ("realisable (one shared batch cap)" if realizable
            else "optimal, covering (Σ batch ≥ B)" if cover else "optimal (Σ batch = B)")
    lines = [
        f"profile   {profile.model_id} ({measured}; scope {profile.scope})",
        f"load      batch {shown.batch} on {shown.cores} cores",
        f"plan      {kind}: {len(shown.instances)} instance(s), "
        f"{shown.threads_used} of {shown.cores} threads",
        "",
        f"  {'count':>5}  {'threads':>7}  {'batch':>5}  {'latency_ms':>11}",
    ]
    groups: dict[tuple[int, int, float], int] = {}
    for i in shown.instances:  # already sorted (threads, batch) descending
        key = (i.threads, i.batch, i.latency_ms)
        groups[key] = groups.get(key, 0) + 1
    for (t, b, ms), n in groups.items():
        lines.append(f"  {n:>5}  {t:>7}  {b:>5}  {ms:>11.3f}")
    lines.append("")
    lines.append(f"predicted latency  {shown.predicted_latency_ms:.3f} ms")
    if shown.fat_latency_ms is None:
        lines.append(f"fat latency        n/a (threads={shown.cores}, batch={shown.batch} "
                     "not profiled)")
    else:
        lines.append(f"fat latency        {shown.fat_latency_ms:.3f} ms "
                     f"(1 instance, {shown.cores} threads, batch {shown.batch})")
        lines.append(f"expected speedup   {shown.expected_speedup:.2f}x")
    from packrat.plan import realizable_gap

    optimal, real = (other, shown) if realizable else (shown, other)
    if isinstance(other, str):
        what = ("unconstrained optimum" + (" (covering)" if cover else "")
                if realizable else "realisable plan")
        lines.append(f"{what}: none ({other})")
    else:
        assert isinstance(optimal, Plan) and isinstance(real, Plan)
        gap = realizable_gap(optimal, real)
        if realizable:
            lines.append(f"unconstrained      {optimal.predicted_latency_ms:.3f} ms "
                         f"({'covering, ' if cover else ''}"
                         f"this plan is {gap:+.1%} slower)")
        else:
            caps = real.instances[0]
            lines.append(f"realisable         {real.predicted_latency_ms:.3f} ms "
                         f"({len(real.instances)} x {caps.threads} threads, cap {caps.batch}; "
                         f"gap {gap:+.1%})")
    return "\n".join(lines)


def run_plan(profile_path: Path, cores_text: str, batch_text: str, as_json: bool,
             realizable: bool, plot: Path | None, cover: bool = False) -> str:
    """Everything `packrat plan` does, returning its output; PackratError on bad input."""
    from packrat.plan import optimal_plan, realizable_plan
    from packrat.profile import load_profile

    cores = _positive_int(cores_text, "--cores")
    batch = _positive_int(batch_text, "--batch")
    profile = load_profile(profile_path)

    def optimum(p: Profile, t: int, b: int) -> Plan:
        return optimal_plan(p, t, b, cover=cover)

    if realizable:
        shown = realizable_plan(profile, cores, batch)
    else:
        shown = optimum(profile, cores, batch)
    if plot is not None:
        from packrat.plan.plot import plot_plan

        try:
            plot_plan(profile, shown, plot)
        except (OSError, ValueError) as exc:
            raise PackratError(f"cannot write plot {plot}: {exc}") from exc
    if as_json:
        return json.dumps(shown.to_dict())
    other = _try(optimum if realizable else realizable_plan, profile, cores, batch)
    text = _render_table(profile, shown, other, realizable, cover)
    if realizable:
        plain = realizable_plan(profile, cores, batch, noise_guard=False)
        if plain.shape != shown.shape:
            caps = plain.instances[0]
            text += (f"\nkept fat           the lowest figure, {len(plain.instances)} x "
                     f"{caps.threads} threads cap {caps.batch} at {plain.predicted_latency_ms:.3f} ms, "
                     f"is not faster than fat beyond the profile's noise (Welch, 5 %)")
    return text


def run_plan_modes(profile_paths: list[Path], cores_text: str, batch_text: str, as_json: bool,
                   realizable: bool, cover: bool = False) -> str:
    """`packrat plan` given several profiles (one per execution mode): each mode's
    best plan, then the overall choice: the tune's rule, the first given whose predicted
    latency is within MODE_MARGIN (3 %) of the lowest."""
    from packrat.plan import MODE_MARGIN, fastest, plans_per_mode
    from packrat.profile import load_profile

    cores = _positive_int(cores_text, "--cores")
    batch = _positive_int(batch_text, "--batch")
    profiles = [load_profile(p) for p in profile_paths]
    per_mode, best = plans_per_mode(profiles, cores, batch, realizable=realizable, cover=cover)
    if as_json:
        return json.dumps({
            "cores": cores, "batch": batch,
            "modes": [{"mode": m.mode, "profile": str(path), "model_id": m.profile.model_id,
                       "plan": m.plan.to_dict() if m.plan else None, "reason": m.reason}
                      for m, path in zip(per_mode, profile_paths)],
            "best": None if best is None else best.mode,
        })
    kind = "realisable" if realizable else "optimal, covering" if cover else "optimal"
    lines = [f"load      batch {batch} on {cores} cores; best {kind} plan per execution mode", "",
             f"  {'mode':<22} {'predicted_ms':>12} {'fat_ms':>9}  instances (threads x batch)"]
    for m in per_mode:
        if m.plan is None:
            lines.append(f"  {m.mode:<22} {'-':>12} {'-':>9}  none: {' '.join(str(m.reason).split())}")
            continue
        fat = "-" if m.plan.fat_latency_ms is None else f"{m.plan.fat_latency_ms:.3f}"
        shape = ", ".join(f"{i.threads}x{i.batch}" for i in m.plan.instances)
        lines.append(f"  {m.mode:<22} {m.plan.predicted_latency_ms:>12.3f} {fat:>9}  {shape}")
    lines.append("")
    if best is None:
        raise PlanError(f"no mode has a plan for batch {batch} on {cores} cores")
    quickest = fastest(per_mode)
    kept = ("" if quickest is best else f"; kept before {quickest.mode} ({quickest.plan.predicted_latency_ms:.3f} "
            f"ms), which is not more than {MODE_MARGIN:.0%} faster")
    lines.append(f"choice    {best.mode}: {best.plan.predicted_latency_ms:.3f} ms predicted "
                 f"({len(best.plan.instances)} instance(s))" + kept)
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_command(
        profile: list[Path] = typer.Option(..., "--profile", metavar="FILE",
                                           help="profile JSON (packrat profile) or CSV with "
                                                "threads,batch,latency_ms; repeat it with one "
                                                "profile per execution mode to choose the mode"),
        # Parsed here rather than by click so that bad values get one line, exit 2.
        cores: str = typer.Option(..., "--cores", metavar="T", help="cores to plan for"),
        batch: str = typer.Option(..., "--batch", metavar="B",
                                  help="load: requests in flight at once"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
        realizable: bool = typer.Option(False, "--realizable",
                                        help="one batch cap shared by all instances "
                                             "(what one TorchServe version can run)"),
        plot: Optional[Path] = typer.Option(None, "--plot", metavar="OUT.png",
                                            help="draw the profile with the plan marked"),
        cover: bool = typer.Option(False, "--cover",
                                   help="allow Σ batch ≥ B (instances may get short "
                                        "batches): a plan for every B that fits"),
    ) -> None:
        """Choose thin instances (threads, batch) minimising latency for batch B on T cores."""
        try:
            if len(profile) > 1:
                if plot is not None:
                    raise PackratError("--plot takes a single --profile")
                out = run_plan_modes(profile, cores, batch, as_json, realizable, cover)
            else:
                out = run_plan(profile[0], cores, batch, as_json, realizable, plot, cover)
        except PackratError as exc:
            message = " ".join(str(exc).split())  # one line, whatever the message held
            typer.echo(f"error: {message}", err=True)
            raise typer.Exit(2) from None
        typer.echo(out)
