"""The step-load benchmark's outputs (scripts/bench_step_reaction.py): the trace saved first
as docs/benchmarks/<stem>-trace.json, then <stem>.md and <stem>.png rendered from that file
only (packrat.bench.step_reaction.analyse)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packrat.bench.paths import RESULTS
from packrat.bench.step_reaction import (
    ALTERNATE_DURATION_S, WINDOWS_S, alternate_rows, analyse, archive_models, live_at, run,
    scenario_levels, sleep_models,
)

_SCENARIO_TEXT = {
    "one": "one model, closed-loop clients 1 → 8 → 1 → 8",
    "two": "two models, 8 closed-loop clients moving from the first to the second and back",
    "alternate": "two models, 8 closed-loop clients moving from one to the other every phase",
}


def _f(x: object) -> str:
    return "–" if x is None else f"{x:g}" if isinstance(x, float) else str(x)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f} %"


def _front_matter(tr: dict, rows: list[dict]) -> list[str]:
    """The results-file header every page under docs/benchmarks/ carries (docs/benchmarks/README.md)."""
    steps = [r for r in rows if r["phase"] > 0]
    live = [r["right_plan_live_after_s"] for r in steps if isinstance(r["right_plan_live_after_s"], (int, float))]
    figures = (f"right plan live {min(live):.1f}-{max(live):.1f} s after a step" if live else "no step answered")
    figures += f"; {sum(r['failed'] for r in rows)} failed requests"
    return _header(tr, figures)


def _header(tr: dict, figures: str) -> list[str]:
    return ["---", f"date: {tr['created'][:10]} {tr['created'][11:16]}",
            f"machine: {tr['machine']['cpu']}, {tr['machine']['cores']} cores",
            f"command: {tr['command']}", f"figures: {figures}", "---", ""]


def _run_lines(tr: dict, stem: str, what: str) -> list[str]:
    """The run's paragraph and the plot (both pages)."""
    m = tr["machine"]
    return [
        f"Run {tr['created']} on {m['cores']} cores (CPU: {m['cpu']}; load average {m['loadavg_start']:.1f} "
        f"at the start, {m['loadavg_end']:.1f} at the end: the machine was shared). Command: "
        f"`{tr['command']}`. Trace: `{stem}-trace.json`; this page and `{stem}.png` are rendered from it.",
        "",
        f"![{what}]({stem}.png)",
        "",
    ]


def _controller_line(tr: dict) -> str:
    pol, est = tr["settings"]["policy"], tr["settings"]["estimator"]
    return (f"- The controller as users run it: tick {tr['settings']['tick_s']:g} s, default policy "
            f"(gain threshold {100 * pol['gain_threshold']:g} %, dwell {pol['min_dwell_s']:g} s at the threshold "
            f"scaled by (threshold / gain)^{pol['dwell_power']:g}, at most {pol['max_swaps_per_window']} swaps in "
            f"{pol['swap_window_s']:g} s, B held {pol['min_stable_s']:g} s; estimator window {est['window_s']:g} s).")


def _models_line(tr: dict) -> str:
    models = ", ".join(f"`{x['name']}` ({'table-latency sleep model' if x['kind'] == 'sleep' else 'archive'})"
                       for x in tr["models"])
    return (f"- Models: {models}; each phase {tr['phase_s']:g} s; each model starts on the plan for its first "
            "phase's clients.")


def render_md(tr: dict, rows: list[dict], stem: str) -> str:
    lines = _front_matter(tr, rows) + [
        f"# Step load: {_SCENARIO_TEXT.get(tr.get('scenario', ''), tr.get('scenario', ''))}",
        "",
    ] + _run_lines(tr, stem, "step load") + [
        _models_line(tr),
        _controller_line(tr),
        "- *first swap live*: seconds from the step until the first swap landing in the phase started serving.",
        "- *right plan live*: seconds from the step until the plan the controller kept to the phase's end "
        "started serving (swaps.jsonl: start + create + register + ready + set-default of the last swap "
        "landing in the phase; 0 when none landed, – when a swap was still running or failed at the end).",
        "- *first N s*: answered requests per second the clients counted in the first N s after the step, "
        "as a share of the *settled* rate (the phase's last "
        f"{_f(rows[0]['settled_over_s']) if rows else '–'} s); – where the phase is shorter than N.",
        "",
        "| model | phase | clients | swap decided [s] | first swap live [s] | right plan live [s] | "
        "plan at end (threads/cap) | "
        "settled [req/s] | " + " | ".join(f"first {w} s" for w in WINDOWS_S) + " | swaps | requests | failed |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(WINDOWS_S) + "---|---|---|",
    ]
    for r in rows:
        plan = " + ".join(f"{t}/{b}" for t, b in r["plan_at_end"]) if r["plan_at_end"] else "–"
        failed_swaps = f" ({r['swaps_failed']} failed)" if r["swaps_failed"] else ""
        firsts = " | ".join(f"{_f(r[f'first_{w}s_rps'])} ({_pct(r[f'first_{w}s_of_settled'])})"
                            for w in WINDOWS_S)
        lines.append(f"| {r['model']} | {r['phase']} | {r['clients']} | {_f(r['swap_decided_after_s'])} | "
                     f"{_f(r['first_swap_live_after_s'])} | {_f(r['right_plan_live_after_s'])} | {plan} | "
                     f"{_f(r['settled_rps'])} | {firsts} | {r['swaps']}{failed_swaps} | "
                     f"{r['requests']} | {r['failed']} |")
    lines += ["", "Phase 0 is the start (its plan applied before the load began), not a step.", ""]
    return "\n".join(lines)


def _alternate_figures(rows: list[dict]) -> str:
    names = " and ".join(r["model"] for r in rows)
    return (f"{names}: most swaps in a sliding 60 s window {' and '.join(str(r['max_swaps_60s']) for r in rows)} "
            f"({' and '.join(str(r['swaps']) for r in rows)} in {rows[0]['load_s'] / 60:.1f} min: "
            f"{' and '.join(_f(r['swaps_per_min']) for r in rows)} a minute); live plan below its share "
            f"{' and '.join(_f(r['below_share_s']) for r in rows)} s of "
            f"{' and '.join(_f(r['loaded_s']) for r in rows)} s loaded; "
            f"{sum(r['failed'] for r in rows)} failed requests")


def _swap_lines(tr: dict) -> list[str]:
    """The policy's swap decisions during the load: which rule let each one through."""
    t0 = min(ch[0][0] for ch in tr["level_changes"].values())
    t1 = max(ch[-1][0] for ch in tr["level_changes"].values())
    out = []
    for d in tr["decisions"]:
        if d["swap"] and t0 <= d["time_s"] < t1:
            out.append(f"- {d['time_s'] - t0:.1f} s, `{d['model']}`: {d['reason']} (estimated B "
                       f"{_f(d.get('estimated_batch'))}, corrected gain {_f(d.get('corrected_gain'))}, "
                       f"dwell {_f(d.get('dwell_s'))} s, estimate stable {_f(d.get('estimate_stable_s'))} s)")
    return out or ["- none"]


def _fast_rule_line(pol: dict) -> list[str]:
    """The policy's hold on B after a clear step (43cd5af), where the trace's policy has it."""
    if "fast_stable_s" not in pol:
        return []
    return [f"- B is held {pol['min_stable_s']:g} s, or {pol['fast_stable_s']:g} s when B took its value at a "
            f"clear step and the corrected gain is ≥ {pol['fast_gain']:g}; *cores-moved* (the live version's "
            "workers outside the model's division) is not held by the dwell."]


def render_alternate_md(tr: dict, rows: list[dict], stem: str) -> str:
    """The alternate scenario's page: per model over the whole load (step_reaction.alternate_row)."""
    pol, sh = tr["settings"]["policy"], tr["shares"]
    lines = _header(tr, _alternate_figures(rows)) + [
        f"# Alternating load: {_SCENARIO_TEXT['alternate']}", ""] + _run_lines(tr, stem, "alternating load") + [
        _models_line(tr), _controller_line(tr),
        f"- *swaps*: swaps started while the clients ran; *a minute*: their number over the load's minutes; "
        f"*most in 60 s / 120 s*: the most that started in any sliding window [t, t + 60 s) / [t, t + 120 s) "
        f"(the policy's bound: {pol['max_swaps_per_window']} in {pol['swap_window_s']:g} s).",
        f"- *share*: the cores `packrat.plan.share.divide_cores` (the controller's division) gives the model "
        f"at B = {sh['batch']} when it is the only one with clients (*alone*), or when both have (*all*), with the "
        "controller's own predictor over the profiles it holds; computed at the start of the run.",
        "- *live plan cores*: seconds the model had clients, by the cores of its live plan (the last applied "
        "swap serving: swaps.jsonl plan.cores); *below share*: those seconds its live plan had fewer cores "
        "than its share then; *division below share*: seconds the controller's own division (sampled every "
        "0.25 s) gave it fewer cores than that share while it had clients; *below division*: seconds its "
        "live plan had fewer cores than the division gave it then.",
    ] + _fast_rule_line(pol) + [
        "",
        "| model | loaded [s] | swaps | a minute | most in 60 s | most in 120 s | swaps the policy asked "
        "(reason: n) | share alone / all | live plan cores while loaded [cores: s] | below share [s] | "
        "division below share [s] | below division [s] | answered req/s while loaded | requests | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        failed = f" ({r['swaps_failed']} failed)" if r["swaps_failed"] else ""
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(r["swap_reasons"].items())) or "–"
        cores = ", ".join(f"{k}: {v:g}" for k, v in sorted(r["live_cores_s"].items()))
        lines.append(f"| {r['model']} | {_f(r['loaded_s'])} | {r['swaps']}{failed} | {_f(r['swaps_per_min'])} | "
                     f"{r['max_swaps_60s']} | {r['max_swaps_120s']} | {reasons} | {r['share_alone']} / "
                     f"{r['share_all']} | {cores} | {_f(r['below_share_s'])} | {_f(r['division_below_share_s'])} | "
                     f"{_f(r['below_division_s'])} | "
                     f"{_f(r['answered_rps_loaded'])} | {r['requests']} | {r['failed']} |")
    worst = max(r["max_swaps_60s"] for r in rows)
    lines += ["", "Against issue 32's targets, as measured:", "",
              f"- ≤ 1 swap per model per minute: {'met' if worst <= 1 else 'missed'} (most in a sliding 60 s "
              f"window: {worst}; per minute over the load: {', '.join(_f(r['swaps_per_min']) for r in rows)}).",
              f"- no model on fewer cores than its share while loaded: "
              f"{'met' if all(r['below_share_s'] == 0 for r in rows) else 'missed'} "
              f"({', '.join(_f(r['below_share_s']) + ' s' for r in rows)} below).",
              f"- 0 failed requests: {sum(r['failed'] for r in rows)} failed.",
              "", "The policy's swap decisions while the clients ran (seconds since the load started):", ""]
    return "\n".join(lines + _swap_lines(tr) + [""])


def _cores_overlay(tr: dict) -> Callable[[Any, str, float], None]:
    """Draws the live plan's cores and the model's alone share on the clients' axis."""
    def draw(ax: Any, name: str, t0: float) -> None:
        end = max(ch[-1][0] for ch in tr["level_changes"].values()) - t0
        applied = sorted((s for s in tr["swaps"] if s["model"] == name and s["outcome"] == "applied"
                          and live_at(s) - t0 < end), key=live_at)  # those serving while the clients ran
        xs = [max(live_at(s) - t0, 0.0) for s in applied] + [end]
        ys = [s["plan"]["cores"] for s in applied]
        if ys:
            ax.step(xs, ys + ys[-1:], where="post", color="tab:orange", lw=1.5, label="live plan cores")
        ax.axhline(tr["shares"]["alone"][name], color="tab:orange", ls=":", lw=1, label="share (alone)")
        ax.legend(loc="upper right", fontsize=8)
    return draw


def plot(tr: dict, path: Path, overlay: Callable[[Any, str, float], None] | None = None) -> None:
    """Per model: answered requests per second (1 s bins), the clients, swaps landing;
    overlay(clients axis, model, t0) draws more on the clients' axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(tr["level_changes"])
    t0 = min(ch[0][0] for ch in tr["level_changes"].values())
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 3.2 * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        ends = sorted(e - t0 for _, e, st in tr["requests"][name] if st == 200)
        n = int(ends[-1]) + 1 if ends else 0
        bins = [0] * n
        for e in ends:
            if e >= 0:
                bins[int(e)] += 1
        ax.plot([i + 0.5 for i in range(n)], bins, color="tab:blue", lw=1, label="answered req/s (clients' count)")
        ax.set_ylabel(f"{name}\nreq/s")
        cl = ax.twinx()
        ch = tr["level_changes"][name]
        cl.step([t - t0 for t, _ in ch], [c for _, c in ch], where="post", color="0.5", lw=2, label="clients")
        cl.set_ylabel("clients")
        cl.set_ylim(0, 12)  # the clients line below the throughput plateau, not over it
        if overlay is not None:
            overlay(cl, name, t0)
        for s in tr["swaps"]:
            if s["model"] != name:
                continue
            x = live_at(s) - t0
            ok = s["outcome"] == "applied"
            ax.axvline(x, color="tab:green" if ok else "red", ls="--", lw=1)
            ax.annotate(" + ".join(f"{i['threads']}t/b{i['batch']}" for i in s["plan"]["instances"]),
                        (x, 0), xycoords=("data", "axes fraction"), fontsize=7, rotation=90,
                        xytext=(2, 4), textcoords="offset points")
        ax.legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("time since the load started [s] (dashed: a swap's new plan serving)")
    fig.suptitle(f"Step load through the Packrat controller ({tr['machine']['cores']} cores, {tr['machine']['cpu']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def trace_and_render(stem: str, scenario: str, phase_s: float, settled_s: float, from_trace: bool,
                     model_dirs: list[Path], profiles: list[Path], bodies: list[bytes],
                     command: str = "", out_dir: Path = RESULTS,
                     duration_s: float = ALTERNATE_DURATION_S) -> list[dict]:
    """Run (unless from_trace) and save <out_dir>/<stem>-trace.json, then render <stem>.md
    and <stem>.png from that file only; returns the rows (alternate: one per model)."""
    trace = out_dir / f"{stem}-trace.json"
    if not from_trace:
        levels = scenario_levels(scenario, phase_s, duration_s)
        models = (archive_models(model_dirs, profiles, bodies) if model_dirs
                  else sleep_models(len(levels)))
        if len(models) != len(levels):
            raise ValueError(f"scenario {scenario!r} takes {len(levels)} model(s), got {len(models)}")
        tr = run(models, levels, phase_s, command=command)
        tr["scenario"] = scenario
        trace.write_text(json.dumps(tr, separators=(",", ":")) + "\n")
    tr = json.loads(trace.read_text())
    if tr.get("scenario") == "alternate":
        rows = alternate_rows(tr)
        plot(tr, out_dir / f"{stem}.png", overlay=_cores_overlay(tr))
        (out_dir / f"{stem}.md").write_text(render_alternate_md(tr, rows, stem))
        return rows
    rows = analyse(tr, settled_s)
    plot(tr, out_dir / f"{stem}.png")
    (out_dir / f"{stem}.md").write_text(render_md(tr, rows, stem))
    return rows
