"""Reports from saved benchmark results only: markdown, CSV and a PNG chart.

Per model and load B the headline latency is the median (p50) end-to-end
latency of B closed-loop clients; every ratio below uses it:

* speedup over fat      = fat p50 / packrat p50        (> 1: packrat faster)
* speedup over defaults = defaults p50 / packrat p50
* regret                = packrat p50 / oracle p50 - 1 (oracle = fastest measured
                          realisable shape at that B: the "oracle" candidates plus
                          fat, which is the candidate ⟨1, T, B⟩ and is measured once;
                          packrat is measured on its own even when its shape is a
                          candidate, so < 0 means its run beat the candidate's run:
                          the size of that is the noise between two runs)
* prediction gap        = packrat p50 / predicted - 1  (predicted = the optimiser's
                          max_i L(t_i, b_i) from the isolated profile)
* worker gap            = packrat worker_ms / predicted - 1, worker_ms being TorchServe's
                          own mean (inference - queue) latency over the point: the
                          part of the end-to-end time the profile predicts
* repeat noise          = |p50 a / p50 b - 1| for two runs of the same shape in the
                          same mode at the same B in one run (packrat's plan and the
                          oracle candidate of its shape; tuned and fat-tuned, ...: see
                          TWINS); the largest of them is the run's noise band, and
                          "packrat vs fat" is called faster / tie / slower against it

With tuning (packrat bench --tuned; fat-tuned = 1 worker x T threads, cap B, in
the mode tuned for B; tuned = the tuned (mode, plan) for B):

* mode gain             = fat p50 / fat-tuned p50   (same shape, other mode)
* shape gain            = fat-tuned p50 / tuned p50 (same mode, other shape),
                          called faster / tie / slower against the noise band
* total gain            = fat p50 / tuned p50 = mode gain x shape gain

A measurement with failed requests is shown but never used as a latency.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from packrat.bench.results import CONFIGS, Measurement, read_measurements, read_records


@dataclass(frozen=True)
class SummaryRow:
    model: str
    batch: int
    fat_ms: float | None
    defaults_ms: float | None
    packrat_ms: float | None
    packrat_shape: str | None
    oracle_ms: float | None
    oracle_shape: str | None
    predicted_ms: float | None
    speedup_vs_fat: float | None
    speedup_vs_defaults: float | None
    regret: float | None
    prediction_gap: float | None
    packrat_throughput_rps: float | None
    fat_throughput_rps: float | None
    cut_short: str = ""  # configs whose measurement the time bound stopped early (fewer samples)
    worker_ms: float | None = None  # packrat's TorchServe-side mean (inference - queue) latency
    worker_gap: float | None = None
    vs_fat: str = ""  # "faster" | "tie" | "slower" against the run's noise band; "" unknown
    oracle_shape_match: bool | None = None  # packrat's shape is the oracle's best shape
    # With tuning: fat in the archive's own mode (fat_mode), fat-tuned and tuned in tuned_mode.
    fat_mode: str | None = None
    fat_tuned_ms: float | None = None
    tuned_ms: float | None = None
    tuned_mode: str | None = None
    tuned_shape: str | None = None
    tuned_predicted_ms: float | None = None
    mode_gain: float | None = None  # fat / fat-tuned
    shape_gain: float | None = None  # fat-tuned / tuned
    total_gain: float | None = None  # fat / tuned
    vs_fat_tuned: str = ""  # tuned against fat-tuned: "faster" | "tie" | "slower" | "same shape" | ""


@dataclass(frozen=True)
class RepeatPair:
    """Two runs of one shape at one B in the same run: their difference is noise."""

    model: str
    batch: int
    shape: str
    first_ms: float
    second_ms: float
    mode: str | None = None

    @property
    def diff(self) -> float:
        return abs(self.second_ms / self.first_ms - 1.0)


# A configuration measured on its own even when its (mode, shape) is another's: each
# such pair at one (model, B) is one configuration run twice, minutes apart.
TWINS: dict[str, tuple[str, ...]] = {
    "packrat": ("fat", "oracle"),
    "fat-tuned": ("fat", "oracle", "packrat"),  # when the tuned mode is the archive's own
    "tuned": ("fat-tuned", "fat", "oracle", "packrat"),
}


def repeat_pairs(ms: Sequence[Measurement]) -> list[RepeatPair]:
    """Every measurement beside its twins (same model, B, mode and shape; see TWINS)."""
    by_key = latest(ms)
    out = []
    for m in by_key.values():
        if m.config not in TWINS or not m.valid:
            continue
        twins = [o for o in by_key.values() if o.model == m.model and o.batch == m.batch
                 and o.config in TWINS[m.config] and o.shape == m.shape and o.mode == m.mode and o.valid]
        for o in twins:
            first, second = sorted((o, m), key=lambda x: x.time)
            out.append(RepeatPair(m.model, m.batch, m.shape, first.p50, second.p50, m.mode))
    return sorted(out, key=lambda r: (r.model, r.batch))


def noise_band(pairs: Sequence[RepeatPair]) -> float | None:
    """The largest same-shape difference of the run (None without any repeat)."""
    return max((p.diff for p in pairs), default=None)


def verdict(speedup: float | None, band: float | None) -> str:
    if speedup is None or band is None:
        return ""
    if speedup > 1.0 + band:
        return "faster"
    if speedup < 1.0 / (1.0 + band):
        return "slower"
    return "tie"


def server(m: Measurement | None) -> dict:
    return (m.extra.get("server") or {}) if m is not None else {}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def latest(ms: Sequence[Measurement]) -> dict[tuple[str, int, str, str], Measurement]:
    """The last measurement of each (model, B, config, shape): a rerun replaces, never averages."""
    out: dict[tuple[str, int, str, str], Measurement] = {}
    for m in sorted(ms, key=lambda m: m.time):
        out[(m.model, m.batch, m.config, m.shape)] = m
    return out


def summarise(ms: Sequence[Measurement]) -> list[SummaryRow]:
    band = noise_band(repeat_pairs(ms))
    by_key = latest(ms)
    groups: dict[tuple[str, int], list[Measurement]] = {}
    for m in by_key.values():
        groups.setdefault((m.model, m.batch), []).append(m)
    rows = []
    for (model, batch), group in sorted(groups.items()):

        def one(config: str) -> Measurement | None:
            cands = [m for m in group if m.config == config and m.valid]
            return max(cands, key=lambda m: m.time) if cands else None

        fat, defaults, packrat = one("fat"), one("defaults"), one("packrat")
        fat_tuned, tuned = one("fat-tuned"), one("tuned")
        ft, tn = (fat_tuned.p50 if fat_tuned else None), (tuned.p50 if tuned else None)
        shape_gain = _ratio(ft, tn)
        oracle_cands = [m for m in group if m.config in ("oracle", "fat") and m.valid]
        oracle = min(oracle_cands, key=lambda m: m.p50) if oracle_cands else None
        p = packrat.p50 if packrat else None
        regret = _ratio(p, oracle.p50 if oracle else None)
        gap = _ratio(p, packrat.predicted_ms if packrat else None)
        worker_ms = server(packrat).get("worker_ms")
        worker_gap = _ratio(worker_ms, packrat.predicted_ms if packrat else None)
        speedup = _ratio(fat.p50 if fat else None, p)
        rows.append(
            SummaryRow(
                model=model,
                batch=batch,
                fat_ms=fat.p50 if fat else None,
                defaults_ms=defaults.p50 if defaults else None,
                packrat_ms=p,
                packrat_shape=packrat.shape if packrat else None,
                oracle_ms=oracle.p50 if oracle else None,
                oracle_shape=oracle.shape if oracle else None,
                predicted_ms=packrat.predicted_ms if packrat else None,
                speedup_vs_fat=speedup,
                speedup_vs_defaults=_ratio(defaults.p50 if defaults else None, p),
                regret=None if regret is None else regret - 1.0,
                prediction_gap=None if gap is None else gap - 1.0,
                packrat_throughput_rps=packrat.load.get("throughput_rps") if packrat else None,
                fat_throughput_rps=fat.load.get("throughput_rps") if fat else None,
                cut_short=",".join(sorted({m.config for m in group if _cut(m)})),
                worker_ms=worker_ms,
                worker_gap=None if worker_gap is None else worker_gap - 1.0,
                # Fat's own shape measured twice is a repeat, never a win or a loss.
                vs_fat="same shape" if packrat and fat and packrat.shape == fat.shape else verdict(speedup, band),
                oracle_shape_match=(packrat.shape == oracle.shape) if packrat and oracle else None,
                fat_mode=fat.mode if fat else None,
                fat_tuned_ms=ft,
                tuned_ms=tn,
                tuned_mode=tuned.mode if tuned else (fat_tuned.mode if fat_tuned else None),
                tuned_shape=tuned.shape if tuned else None,
                tuned_predicted_ms=tuned.predicted_ms if tuned else None,
                mode_gain=_ratio(fat.p50 if fat else None, ft),
                shape_gain=shape_gain,
                total_gain=_ratio(fat.p50 if fat else None, tn),
                vs_fat_tuned=("same shape" if tuned and fat_tuned and tuned.shape == fat_tuned.shape
                              and tuned.mode == fat_tuned.mode else verdict(shape_gain, band)),
            )
        )
    return rows


# -- rendering -----------------------------------------------------------------


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:+.1f} %"


def _x(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}x"


def summary_markdown(rows: Sequence[SummaryRow]) -> str:
    out = []
    for model in sorted({r.model for r in rows}):
        out += [
            f"### {model}",
            "",
            "| B | fat p50 ms | defaults p50 ms | packrat p50 ms | packrat shape | oracle p50 ms | oracle shape"
            " | packrat vs fat | packrat vs defaults | regret vs oracle | predicted ms | prediction gap"
            " | worker ms | worker gap | cut short |",
            "|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in (r for r in rows if r.model == model):
            out.append(
                f"| {r.batch} | {_f(r.fat_ms)} | {_f(r.defaults_ms)} | {_f(r.packrat_ms)} | {r.packrat_shape or '–'}"
                f" | {_f(r.oracle_ms)} | {r.oracle_shape or '–'}"
                f"{' (=)' if r.oracle_shape_match else ''} | {_x(r.speedup_vs_fat)}{f' {r.vs_fat}' if r.vs_fat else ''}"
                f" | {_x(r.speedup_vs_defaults)} | {_pct(r.regret)} | {_f(r.predicted_ms)} | {_pct(r.prediction_gap)}"
                f" | {_f(r.worker_ms)} | {_pct(r.worker_gap)} | {r.cut_short or ''} |"
            )
        out.append("")
    return "\n".join(out)


def tuned_markdown(rows: Sequence[SummaryRow]) -> str:
    """Mode gain x shape gain per model and B; "" when no tuned configuration was measured."""
    tuned = [r for r in rows if r.fat_tuned_ms is not None or r.tuned_ms is not None]
    out = []
    for model in sorted({r.model for r in tuned}):
        out += [
            f"### {model}",
            "",
            "| B | fat p50 ms | fat mode | fat-tuned p50 ms | tuned mode | tuned shape | tuned p50 ms"
            " | mode gain | shape gain | total gain | tuned vs fat-tuned | tuned predicted ms |",
            "|---:|---:|---|---:|---|---|---:|---:|---:|---:|---|---:|",
        ]
        for r in (r for r in tuned if r.model == model):
            out.append(
                f"| {r.batch} | {_f(r.fat_ms)} | {r.fat_mode or '–'} | {_f(r.fat_tuned_ms)} | {r.tuned_mode or '–'}"
                f" | {r.tuned_shape or '–'} | {_f(r.tuned_ms)} | {_x(r.mode_gain)} | {_x(r.shape_gain)}"
                f" | {_x(r.total_gain)} | {r.vs_fat_tuned or '–'} | {_f(r.tuned_predicted_ms)} |"
            )
        out.append("")
    return "\n".join(out)


def tunes_markdown(records: Sequence[dict]) -> str:
    """One line per tune: time, outcome, each mode's state, the choice at the tune's B."""
    lines = []
    for r in records:
        if r.get("kind") != "tune":
            continue
        modes = ", ".join(
            f"{m} {d.get('state')}" + (f" ({str(d['reason'])[:120]})" if d.get("state") in ("refused", "failed")
                                      and d.get("reason") else "")
            for m, d in (r.get("modes") or {}).items())
        choice = r.get("choice") or {}
        shape = "+".join(f"{i['threads']}t,b{i['batch']}" for i in choice.get("instances", []))
        lines.append(f"- {r.get('model')}: {r.get('state')} in {r.get('seconds')} s at B={r.get('batch')}"
                     f" (budget {r.get('budget_s')} s); modes: {modes or '–'}"
                     + (f"; choice {choice.get('mode')} [{shape}]" if choice else "")
                     + (f"; error: {str(r['error'])[:200]}" if r.get("error") else "") + "\n")
    return "".join(lines)


def repeats_markdown(pairs: Sequence[RepeatPair]) -> str:
    if not pairs:
        return "No shape was measured twice at one B, so this run has no noise band.\n"
    out = ["| model | B | mode | shape | first p50 ms | second p50 ms | difference |",
           "|---|---:|---|---|---:|---:|---:|"]
    for r in pairs:
        out.append(f"| {r.model} | {r.batch} | {r.mode or '–'} | {r.shape} | {r.first_ms:.1f} | {r.second_ms:.1f} | {r.diff * 100:.1f} % |")
    diffs = sorted(p.diff for p in pairs)
    out += ["", f"Noise band (largest difference): {diffs[-1] * 100:.1f} %; median {diffs[len(diffs) // 2] * 100:.1f} %"
            f" over {len(diffs)} pairs."]
    return "\n".join(out) + "\n"


def measurements_markdown(ms: Sequence[Measurement]) -> str:
    out = [
        "| model | B | config | mode | shape | p50 ms | p95 ms | p99 ms | throughput req/s | ok / planned | errors"
        " | predicted ms | server mean ms | queue ms | worker ms | mean batch |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {c: i for i, c in enumerate(CONFIGS)}
    for m in sorted(latest(ms).values(), key=lambda m: (m.model, m.batch, order[m.config], m.shape)):
        ld = m.load
        errs = str(ld.get("errors", 0))
        if ld.get("error_kinds"):
            errs += " (" + ", ".join(f"{k}: {v}" for k, v in ld["error_kinds"].items()) + ")"
        out.append(
            f"| {m.model} | {m.batch} | {m.config} | {m.mode or '–'} | {m.shape} | {_f(ld.get('p50_ms'))} | {_f(ld.get('p95_ms'))}"
            f" | {_f(ld.get('p99_ms'))} | {_f(ld.get('throughput_rps'))} | {ld.get('ok', 0)} / {ld.get('requested', '?')}"
            f"{' (cut short)' if _cut(m) else ''} | {errs}"
            f" | {_f(m.predicted_ms)} | {_f(server(m).get('mean_ms'))} | {_f(server(m).get('queue_ms'))}"
            f" | {_f(server(m).get('worker_ms'))} | {_f(ld.get('mean_batch_size'))} |"
        )
    return "\n".join(out) + "\n"


def _cut(m: Measurement) -> bool:
    """The time bound stopped it before every planned request was sent."""
    req = m.load.get("requested")
    return req is not None and m.load.get("ok", 0) + m.load.get("errors", 0) < req


def capacity_markdown(records: Sequence[dict]) -> str:
    caps = [r for r in records if r.get("kind") == "capacity"]
    if not caps:
        return ""
    out = [
        "| target | clients | throughput req/s | p50 ms | p99 ms | generator CPU ms/req | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in caps:
        ld = r["load"]
        out.append(
            f"| {r['target']} | {ld['clients']} | {_f(ld.get('throughput_rps'), '{:.0f}')} | {_f(ld.get('p50_ms'), '{:.2f}')}"
            f" | {_f(ld.get('p99_ms'), '{:.2f}')} | {_f(ld.get('generator_cpu_ms_per_request'), '{:.3f}')} | {ld.get('errors', 0)} |"
        )
    return "\n".join(out) + "\n"


def notes_markdown(records: Sequence[dict]) -> str:
    """One line per (model, B, text); the configurations it concerned are listed together."""
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for r in records:
        if r.get("kind") == "note":
            key = (str(r.get("model", "")), str(r.get("batch", "")), str(r.get("text", "")))
            grouped.setdefault(key, [])
            if r.get("config"):
                grouped[key].append(str(r["config"]))
    lines = []
    for (model, batch, text), configs in grouped.items():
        where = f"{model} B={batch}" if batch else model
        lines.append(f"- {where}: {text}" + (f" ({', '.join(configs)})" if configs else "") + "\n")
    return "".join(lines)


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    if not rows:
        path.write_text("")
        return
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)


def measurement_rows(ms: Sequence[Measurement]) -> list[dict]:
    keys = ("ok", "errors", "mean_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms", "throughput_rps",
            "duration_s", "generator_cpu_ms_per_request", "mean_batch_size")
    return [
        {"model": m.model, "batch": m.batch, "config": m.config, "mode": m.mode, "shape": m.shape,
         "predicted_ms": m.predicted_ms, **{k: m.load.get(k) for k in keys},
         **{f"server_{k}": server(m).get(k) for k in ("mean_ms", "queue_ms", "worker_ms")}}
        for m in sorted(latest(ms).values(), key=lambda m: (m.model, m.batch, m.config, m.shape))
    ]


def plot(rows: Sequence[SummaryRow], path: Path) -> None:
    """p50 latency against B, one panel per model, the four configurations as lines."""
    import matplotlib

    matplotlib.use("Agg")  # a file only, never a display
    import matplotlib.pyplot as plt

    models = sorted({r.model for r in rows})
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(5.2 * max(len(models), 1), 4.2), squeeze=False)
    styles = {
        "fat": dict(color="tab:red", marker="s"),
        "defaults": dict(color="tab:gray", marker="^"),
        "packrat": dict(color="tab:blue", marker="o", linewidth=2),
        "oracle": dict(color="tab:green", marker="x", linestyle="--"),
        "fat-tuned": dict(color="tab:orange", marker="s", linestyle="--"),
        "tuned": dict(color="tab:purple", marker="o", linewidth=2),
    }
    try:
        for ax, model in zip(axes[0], models):
            mine = [r for r in rows if r.model == model]
            series = {
                "fat": [(r.batch, r.fat_ms) for r in mine],
                "defaults": [(r.batch, r.defaults_ms) for r in mine],
                "packrat": [(r.batch, r.packrat_ms) for r in mine],
                "oracle": [(r.batch, r.oracle_ms) for r in mine],
                "fat-tuned": [(r.batch, r.fat_tuned_ms) for r in mine],
                "tuned": [(r.batch, r.tuned_ms) for r in mine],
            }
            for name, pts in series.items():
                pts = [(b, v) for b, v in pts if v is not None]
                if pts:
                    ax.plot([b for b, _ in pts], [v for _, v in pts], label=name, **styles[name])
            pred = [(r.batch, r.predicted_ms) for r in mine if r.predicted_ms is not None]
            if pred:
                ax.plot([b for b, _ in pred], [v for _, v in pred], color="tab:blue", linestyle=":",
                        linewidth=1, label="packrat predicted")
            ax.set_xscale("log", base=2)
            batches = sorted({r.batch for r in mine})
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.set_yscale("log")
            ax.set_xlabel("load B (closed-loop clients)")
            ax.set_ylabel("p50 latency (ms)")
            ax.set_title(model)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def write_report(results: str | Path, out_dir: str | Path | None = None, *, chart: bool = True) -> dict[str, Path]:
    """Read `results` (JSONL) and write summary.md, summary.csv, measurements.csv, latency.png."""
    results = Path(results)
    out = Path(out_dir) if out_dir else results.parent
    out.mkdir(parents=True, exist_ok=True)
    records = list(read_records(results))
    ms = read_measurements(results)
    rows = summarise(ms)
    paths = {
        "summary_md": out / "summary.md",
        "summary_csv": out / "summary.csv",
        "measurements_csv": out / "measurements.csv",
    }
    run = next((r for r in records if r.get("kind") == "run"), None)
    md = ["# Benchmark results", ""]
    if run:
        md += [f"Run `{run.get('run_id')}`: `{run.get('command', '')}`", ""]
        if run.get("machine"):
            md += ["Machine: " + ", ".join(f"{k} {v}" for k, v in run["machine"].items()), ""]
    md += ["## Summary (p50 end-to-end latency)", "", summary_markdown(rows),
           "\"(=)\": packrat's shape is the oracle's. \"faster / tie / slower\": packrat against fat, judged"
           " against the noise band below; \"same shape\": packrat chose fat's shape.", ""]
    tuned_md = tuned_markdown(rows)
    if tuned_md:
        md += ["## Mode gain x shape gain (tuned)", "",
               "fat runs the archive's own mode; fat-tuned is fat's shape in the mode tuned for B; tuned is"
               " the tuned (mode, plan) for B. mode gain = fat / fat-tuned, shape gain = fat-tuned / tuned,"
               " total = fat / tuned = mode gain x shape gain (p50). \"tuned vs fat-tuned\": judged against"
               " the noise band below; \"same shape\": the tune chose fat's shape.", "", tuned_md]
    tunes = tunes_markdown(records)
    if tunes:
        md += ["## Tunes (one per model)", "", tunes]
    md += ["## Repeat noise (one shape in one mode measured twice at one B)", "", repeats_markdown(repeat_pairs(ms)),
           "## All measurements", "", measurements_markdown(ms)]
    cap = capacity_markdown(records)
    if cap:
        md += ["", "## Load generator capacity", "", cap]
    notes = notes_markdown(records)
    if notes:
        md += ["", "## Notes", "", notes]
    paths["summary_md"].write_text("\n".join(md))
    write_csv(paths["summary_csv"], [asdict(r) for r in rows])
    write_csv(paths["measurements_csv"], measurement_rows(ms))
    if chart and rows:
        paths["chart"] = out / "latency.png"
        plot(rows, paths["chart"])
    return paths
