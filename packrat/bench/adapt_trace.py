"""The re-plan loop traced through load steps (scripts/adapt_trace.py): docs/<stem>.{png,md}.

run() drives a private TorchServe with the table-latency sleep model (or a real archive
and its profile) through closed-loop load steps while the controller's AdaptiveLoop
ticks; the trace it returns is saved first, and analyse(), plot() and render_md() read
only that trace.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from packrat.bench.adapt_rig import Rig, sleep_table, table_profile
from packrat.bench.loadgen import Step, StepLoad
from packrat.bench.paths import DOCS, REPO, RESULTS
from packrat.bench.sleepmodel import SLEEP_MODEL
from packrat.observe.loop import adapt_settings
from packrat.plan import realizable_plan
from packrat.profile import load_profile

MODEL = "sleepy"


def run(steps_spec: str, min_dwell_s: float, model_dir: Path | None = None,
        profile_path: Path | None = None, body: bytes = b"x") -> dict:
    steps = [Step(int(c), float(d)) for c, d in (s.split(":") for s in steps_spec.split(","))]
    if model_dir is None:
        name, base, kind = MODEL, SLEEP_MODEL, "sleep"
        profile = table_profile(MODEL, sleep_table(SLEEP_MODEL))
    else:
        # A real archive and a profile measured on this machine (packrat profile).
        name, base, kind = model_dir.name, model_dir, "archive"
        profile = load_profile(profile_path)
    settings = adapt_settings(min_dwell_s=min_dwell_s)
    with tempfile.TemporaryDirectory(prefix="packrat-adapt-trace-") as tmp:
        rig = Rig(store=Path(tmp) / "store", workdir=Path(tmp), model=name,
                  base_dir=base, profile=profile, settings=settings)
        with rig:
            rig.apply(realizable_plan(profile, 2, steps[0].clients or 1))
            rig.start_loop(sample_every_s=0.5)
            load = StepLoad(f"{rig.server.inference_url}/predictions/{name}", steps,
                            headers=rig.server.inference_headers, body=body,
                            clock=time.time).start()
            records = load.join(timeout_s=sum(s.duration_s for s in steps) + 120)
            time.sleep(1.0)
            swaps = rig.controller.history(name, last=100)
            decisions = [d for d in rig.decision_log if "reason" in d]
            samples = [asdict(s) for s in rig.samples]
    plans = {str(b): [[i.threads, i.batch] for i in realizable_plan(profile, 2, b).instances]
             for b in sorted({s.clients for s in steps if s.clients})}
    table: dict[str, dict[str, float]] = {}
    for p in sorted(profile.points, key=lambda p: (p.threads, p.batch)):
        table.setdefault(str(p.threads), {})[str(p.batch)] = round(p.mean_ms, 1)
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {"name": name, "kind": kind, "dir": str(base.relative_to(REPO))
                  if base.is_relative_to(REPO) else base.name,
                  "fingerprint": asdict(profile.fingerprint) if profile.fingerprint else None},
        "steps": [asdict(s) for s in steps],
        "settings": {"estimator": asdict(settings.estimator), "policy": asdict(settings.policy),
                     "tick_s": 1.0},
        "profile_ms": table,
        "optimiser_plans": plans,
        "level_changes": load.level_changes,
        "requests": [[round(r.start_s, 4), round(r.end_s, 4), r.status, r.level] for r in records],
        "decisions": decisions,
        "swaps": swaps,
        "samples": samples,
    }


def analyse(tr: dict) -> list[dict]:
    """Per load step: when B was read, when the swap was decided / took effect, latencies."""
    out = []
    changes = tr["level_changes"]
    reqs = tr["requests"]
    for (t0, level), (t1, _) in zip(changes, changes[1:]):
        ds = [d for d in tr["decisions"] if t0 < d["time_s"] <= t1]
        read = next((d["time_s"] - t0 for d in ds if d["estimate"]["ready"]
                     and d["estimated_batch"] == level), None)
        swap = next((d for d in ds if d["swap"]), None)
        landed = None
        if swap is not None:
            rec = next((s for s in tr["swaps"] if s["started_at"] >= swap["time_s"] - 1.0), None)
            if rec is not None and rec.get("outcome") == "applied":
                ph = rec["phases_s"]
                landed = rec["started_at"] + sum(ph.get(k, 0.0) for k in
                                                  ("create", "register", "ready", "set_default")) - t0
        conv = None
        tail = 0
        for d in reversed(ds):
            if d["estimated_batch"] == level and d["reason"] in ("same-plan", "gain-below-threshold"):
                tail += 1
            else:
                break
        if tail:
            conv = ds[len(ds) - tail]["time_s"] - t0
        lat = lambda a, b: [1000 * (e - s) for s, e, st, _ in reqs if a <= s < b and st == 200]  # noqa: E731
        before = lat(t0, t0 + (landed if landed is not None else (t1 - t0) / 2))
        after = lat(t0 + landed, t1) if landed is not None else []
        out.append({
            "clients": level, "duration_s": round(t1 - t0, 1),
            "b_read_after_s": None if read is None else round(read, 1),
            "swap_decided_after_s": None if swap is None else round(swap["time_s"] - t0, 1),
            "swap_to": None if swap is None else [[i["threads"], i["batch"]] for i in swap["target"]["instances"]],
            "swap_landed_after_s": None if landed is None else round(landed, 1),
            "swap_duration_s": (None if swap is None else next(
                (round(s["duration_s"], 1) for s in tr["swaps"]
                 if s["started_at"] >= swap["time_s"] - 1.0), None)),
            "converged_after_s": None if conv is None else round(conv, 1),
            "swaps": sum(1 for d in ds if d["swap"]),
            "p50_before_ms": round(statistics.median(before), 1) if before else None,
            "p50_after_ms": round(statistics.median(after), 1) if after else None,
            "requests": len([r for r in reqs if t0 <= r[0] < t1]),
            "failed": len([r for r in reqs if t0 <= r[0] < t1 and r[2] != 200]),
        })
    return out


def plot(tr: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = tr["level_changes"][0][0]
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(10, 8), sharex=True,
                                     gridspec_kw={"height_ratios": [2, 1.2, 2]})
    # clients (what the load generator does) vs what the loop estimated
    lc = tr["level_changes"]
    a1.step([t - t0 for t, _ in lc], [c for _, c in lc], where="post", color="0.6", lw=3,
            label="clients (closed loop)")
    ds = tr["decisions"]
    a1.plot([d["time_s"] - t0 for d in ds], [d["estimate"]["concurrency"] for d in ds],
            ".", ms=3, color="tab:blue", alpha=0.6, label="Little's-law concurrency (5 s window)")
    ready = [d for d in ds if d["estimate"]["ready"]]
    a1.step([d["time_s"] - t0 for d in ready], [d["estimated_batch"] for d in ready], where="post",
            color="tab:red", label="estimated B (EWMA, pow2, majority)")
    a1.set_ylabel("requests in flight")
    a1.set_yscale("log", base=2)
    a1.set_yticks([1, 2, 4, 8])
    a1.set_yticklabels(["1", "2", "4", "8"])
    a1.legend(loc="upper right", fontsize=8)

    # the active plan: the B it was made for, labelled with its workers
    act = [d for d in ds if d["active_batch"] is not None]
    a2.step([d["time_s"] - t0 for d in act], [d["active_batch"] for d in act], where="post",
            color="tab:green")
    for d in ds:
        if d["swap"]:
            x = d["time_s"] - t0
            a2.axvline(x, color="tab:orange", ls="--", lw=1)
            a2.annotate("swap to " + " + ".join(f"{i['threads']}t/b{i['batch']}" for i in d["target"]["instances"]),
                        (x, d["target"]["batch"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    for s in tr["swaps"]:
        ph = s["phases_s"]
        x = s["started_at"] + sum(ph.get(k, 0.0) for k in ("create", "register", "ready", "set_default")) - t0
        if x > 0:
            a2.axvline(x, color="tab:green", ls=":", lw=1)
    a2.set_ylabel("active plan\nmade for B")
    a2.set_yscale("log", base=2)
    a2.set_yticks([1, 2, 4, 8])
    a2.set_yticklabels(["1", "2", "4", "8"])
    a2.set_ylim(0.7, 16)

    reqs = tr["requests"]
    ok = [(s - t0, 1000 * (e - s)) for s, e, st, _ in reqs if st == 200]
    bad = [(s - t0, 1000 * (e - s)) for s, e, st, _ in reqs if st != 200]
    a3.plot([x for x, _ in ok], [y for _, y in ok], ".", ms=2, color="tab:blue", alpha=0.4,
            label="client latency per request")
    if bad:
        a3.plot([x for x, _ in bad], [y for _, y in bad], "x", color="red", label="failed")
    # rolling median over 2 s
    if ok:
        xs = sorted(ok)
        med_x, med_y = [], []
        j0 = 0
        for i, (x, _) in enumerate(xs):
            while xs[j0][0] < x - 2.0:
                j0 += 1
            if i % 5 == 0:
                med_x.append(x)
                med_y.append(statistics.median(y for _, y in xs[j0:i + 1]))
        a3.plot(med_x, med_y, color="black", lw=1.2, label="median (2 s)")
    a3.set_yscale("log")
    a3.set_ylabel("latency [ms, log]")
    a3.set_xlabel("time since the load started [s]")
    a3.legend(loc="upper right", fontsize=8)
    m = tr.get("model") or {"kind": "sleep"}
    what = "table-latency model" if m["kind"] == "sleep" else m["name"]
    fig.suptitle(f"Packrat re-plan loop through load steps ({what}, 2 cores, tick 1 s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def machine(tr: dict) -> str:
    """The machine of a trace, as its profile's fingerprint names it."""
    fp = (tr.get("model") or {}).get("fingerprint") or {}
    if fp.get("cpu_model"):
        return f"a {fp.get('usable_cores', 2)}-core {fp['cpu_model']}"
    return "a 2-core machine (machine not recorded)"


def model_line(tr: dict) -> str:
    m = tr.get("model") or {"kind": "sleep"}
    if m["kind"] == "sleep":
        return ("- Model: `tests/data/observe/sleepmodel`, whose handler claims and pins its "
                "Packrat slot and then *sleeps* L(threads, batch) ms per batch; its profile is that "
                "same table, so the plans the loop should reach are known exactly and a busy machine "
                "does not bend them. What the trace shows is the loop (estimate, decision, swap), "
                "not model speed-ups. Profile (ms):")
    return (f"- Model: `{m['name']}` (a real archive, served by the Packrat handler), with a "
            f"profile measured by `packrat profile` on the same "
            f"{(m.get('fingerprint') or {}).get('cpu_model') or 'machine'} just before the run "
            f"(fingerprint {m.get('fingerprint')}). Timings on a shared 2-core machine are "
            "noisy; compare within the run only. Profile (mean ms):")


def render_md(tr: dict, rows: list[dict], stem: str) -> str:
    return "\n".join(_setup_lines(tr, stem) + _adaptation_lines(tr, rows))


def _setup_lines(tr: dict, stem: str) -> list[str]:
    est, pol = tr["settings"]["estimator"], tr["settings"]["policy"]
    lines = [
        "# Adaptation: the re-plan loop through load steps",
        "",
        f"Generated by `scripts/adapt_trace.py` on {tr['created']} (trace data: "
        f"`docs/benchmarks/{stem}-trace.json`; the figure and this page are rendered from it only).",
        "",
        f"![adaptation trace]({stem}.png)",
        "",
        "## Setup",
        "",
        f"- A private TorchServe 0.12 (token auth on, loopback) on {machine(tr)}, "
        "shared with other work while the trace ran.",
        model_line(tr),
        "",
        "  | threads | " + " | ".join(f"b={b}" for b in tr["profile_ms"]["1"]) + " |",
        "  |---|" + "---|" * len(tr["profile_ms"]["1"]),
    ]
    for t, row in tr["profile_ms"].items():
        lines.append(f"  | {t} | " + " | ".join(f"{ms:g}" for ms in row.values()) + " |")
    lines += [
        "",
        "- Optimiser's plans (realisable, 2 cores): " + "; ".join(
            f"B={b}: " + " + ".join(f"{t}t/b{c}" for t, c in w) for b, w in tr["optimiser_plans"].items()),
        "- Load: closed loop, " + " → ".join(
            f"{s['clients']} client{'s' if s['clients'] != 1 else ''} for {s['duration_s']:g} s" for s in tr["steps"]) + ".",
        f"- Loop settings: tick {tr['settings']['tick_s']:g} s; Little's-law window "
        f"{est['window_s']:g} s, EWMA α {est['alpha']:g}, majority of {est['mode_k']} ticks; "
        f"estimate must hold {pol['min_stable_s']:g} s; gain threshold "
        f"{100 * pol['gain_threshold']:g} %; dwell {pol['min_dwell_s']:g} s after a swap "
        "(default 60 s; shortened so the trace stays short).",
        "",
    ]
    return lines


def _adaptation_lines(tr: dict, rows: list[dict]) -> list[str]:
    t0 = tr["level_changes"][0][0]
    worst = max(((e - s_, s_ - t0) for s_, e, _, _ in tr["requests"]), default=(0.0, 0.0))
    gaps = [d["latency_gap"] for d in tr["decisions"] if d.get("latency_gap") is not None]
    corr = tr["decisions"][-1]["correction"] if tr["decisions"] else {}
    lines = [
        "## How long adaptation took",
        "",
        "Times are seconds after the load generator changed its number of clients.",
        "",
        "| clients | B read | swap decided | new plan serving | swap took | converged | swaps | "
        "p50 before [ms] | p50 after [ms] | requests | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = lambda x: "–" if x is None else f"{x:g}"  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['clients']} | {f(r['b_read_after_s'])} | {f(r['swap_decided_after_s'])} | "
            f"{f(r['swap_landed_after_s'])} | {f(r['swap_duration_s'])} | {f(r['converged_after_s'])} | "
            f"{r['swaps']} | {f(r['p50_before_ms'])} | {f(r['p50_after_ms'])} | {r['requests']} | "
            f"{r['failed']} |")
    lines += [
        "",
        "- *B read*: first tick whose estimate equals the new number of clients. It lags the step "
        "by the window (the Little's-law value ramps over 5 s) plus the EWMA and the majority "
        "vote. During the ramp the majority rule usually holds the old value, but an "
        "intermediate power of two can win a majority for a few ticks (here 4 on the way from "
        "8 down to 2); it costs no swap because:",
        "- *swap decided*: B must then hold for `min_stable_s` (5 s), so a passing value, or a "
        "burst shorter than the window, does not cost a swap (tests/data/observe/spike.jsonl).",
        "- *new plan serving*: `set-default` of the new version returned (register, workers "
        "READY and pinned, then set-default); *swap took* includes draining and unregistering "
        "the old version.",
        "- *converged*: from here to the end of the step B read the level and the policy kept "
        "the running plan: the best for it (`same-plan`), or within the gain threshold of the "
        "best once the measured latency gap is applied (`gain-below-threshold`).",
        "- p50 before/after: client latency of requests sent before / after the new plan "
        "started serving in that step.",
        "",
        "Where the time goes: ≈ 7–9 s to read a new B (window + EWMA + majority), 5 s hold, "
        "then the swap itself (worker start-up with torch import on a busy 2-core machine). "
        "The controller applies a swap inside its tick, so no decisions are logged while a swap "
        "runs (the gaps in the concurrency dots); none could be taken then anyway.",
        "",
        "Latency during a swap: the median rises while the new version's workers start (they "
        "share the two cores with the serving ones). Slowest request of the run: "
        f"{worst[0]:.2f} s, sent at {worst[1]:.1f} s.",
        "",
        f"Measured gap (observed service time / profile - 1) of the last plan: "
        f"{gaps[-1] if gaps else float('nan'):.3f}; correction at the end: base "
        f"{corr.get('base', 1.0):.3f}, per co-running worker {corr.get('per_corunner', 0.0):+.3f} "
        "(the sleep model has no contention: what remains is TorchServe's and Python's own "
        "time per request).",
        "",
        "An earlier run of this script showed one request stalled for 13 s across a swap: it "
        "was sent just before the register call and finished the moment the call returned. "
        "TorchServe 0.12 answers `register ... synchronous=true` by blocking on the workers' "
        "start-up inside a Netty event-loop thread (ApiUtils.updateModelWorkers: "
        "`statusResponseCompletableFuture.get()`), and the inference and management servers "
        "share that event-loop group (ModelServer: `serverGroups.getChildGroup()` for both), "
        "so a client connection bound to the same thread stalls for the whole registration. "
        "The apply stage now registers asynchronously and polls until the workers are READY "
        "(commit 71a7764); this trace was taken with that change.",
        "",
        "The integration test `tests/test_observe_adapt.py` runs the same 1 → 8 → 2 steps and "
        "asserts at most one swap per step, convergence before each step ends (65 s) and no failed request.",
        "",
    ]
    return lines


def trace_and_render(stem: str, from_trace: bool, steps: str, min_dwell_s: float,
                     model_dir: Path | None, profile: Path | None, body: bytes) -> list[dict]:
    """Run (unless from_trace) and save docs/benchmarks/<stem>-trace.json, then render
    docs/<stem>.png and .md (with docs/<stem>.notes.md, hand-written, if there is one) from
    that file only; returns the per-step rows."""
    trace, png, md = RESULTS / f"{stem}-trace.json", DOCS / f"{stem}.png", DOCS / f"{stem}.md"
    if not from_trace:
        tr = run(steps, min_dwell_s, model_dir, profile, body)
        trace.write_text(json.dumps(tr, separators=(",", ":")) + "\n")
    tr = json.loads(trace.read_text())
    rows = analyse(tr)
    plot(tr, png)
    text = render_md(tr, rows, stem)
    notes = DOCS / f"{stem}.notes.md"
    if notes.exists():
        text += "\n## Notes on this run\n\n" + notes.read_text()
    md.write_text(text)
    return rows
