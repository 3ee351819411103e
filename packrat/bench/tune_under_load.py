"""Tuned vs fat fp32-eager through TorchServe, with the load sent while tuning
(scripts/bench_tuned.py says what is measured; `packrat bench --tuned` measures the same
split at every B without the load during the tune).

Per model, on its own TorchServe with an in-process controller: fat in the archive's mode,
the tune (timed, a light open load checked throughout), the tuned result, fat in the tuned
mode, and the tuned result again (the run's noise band). One JSON object per line in
<out>/results.jsonl; summary() renders the markdown.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import urllib3

from packrat.bench.loadgen import Connection, Target, closed_loop
from packrat.bench.machine import describe_machine
from packrat.bench.run import sample_request
from packrat.bench.tuned import TuneOutcome, fat_plan, run_tune


def shape(plan: dict | None) -> str:
    if not plan:
        return "-"
    groups: dict = {}
    for i in plan["instances"]:
        groups[(i["threads"], i["batch"])] = groups.get((i["threads"], i["batch"]), 0) + 1
    return " + ".join(f"{n}x(t{t},b{b})" for (t, b), n in groups.items())


@dataclass
class _Bench:
    """One model's measurements: B closed-loop clients against what the controller has live."""

    model: str
    ctl: Any  # packrat.control.Controller
    target: Callable[[], Target]
    batch: int
    requests: int
    results: IO[str]
    rows: list[dict] = field(default_factory=list)

    def write(self, rec: dict) -> None:
        self.results.write(json.dumps(rec) + "\n")
        self.results.flush()

    def measure(self, config: str, extra: dict | None = None) -> dict:
        B = self.batch
        res = closed_loop(self.target(), B, self.requests, warmup=3 * B, max_duration_s=600.0)
        st = self.ctl.model_state(self.model)
        rec = {"kind": "point", "model": self.model, "config": config, "mode": st.mode,
               "plan": st.plan.to_dict() if st.plan else None, "load": res.summary(),
               "loadavg": os.getloadavg(), **(extra or {})}
        self.write(rec)
        print(f"{self.model} {config:<16} {st.mode:<18} {shape(rec['plan']):<18} p50 {res.p50_ms:8.1f} ms "
              f"{res.throughput_rps:6.2f} req/s errors {res.errors}", file=sys.stderr)
        self.rows.append(rec)
        return rec

    def tune_under_load(self, rate: float, budget_s: float | None, modes: list[str] | None
                        ) -> tuple[TuneOutcome, list[dict]]:
        """Tune while requests keep arriving (a light open load: every answer is checked,
        but it must not drown the profiles it is measuring on the same cores)."""
        stop = threading.Event()
        during: list[dict] = []

        def keep_loading() -> None:
            t = self.target()
            conn = Connection(t.url, t.timeout_s)
            while not stop.wait(1.0 / rate):
                try:
                    r = conn.post(t.body, t.headers())
                    during.append({"ok": int(r.status == 200), "errors": int(r.status != 200)})
                except urllib3.exceptions.HTTPError:
                    during.append({"ok": 0, "errors": 1})
            conn.close()

        loader = threading.Thread(target=keep_loading, daemon=True)
        t0 = time.monotonic()
        loader.start()
        try:
            outcome = run_tune(self.ctl, self.model, batch=self.batch, budget_s=budget_s, modes=modes,
                               on_progress=lambda text: print(f"  [{time.monotonic() - t0:6.1f} s] {text}",
                                                              file=sys.stderr))
        finally:
            stop.set()
            loader.join()
        return outcome, during


def _bench_model(bench: _Bench, cores: int, rate: float, budget_s: float | None, modes: list[str] | None) -> None:
    model, ctl, B = bench.model, bench.ctl, bench.batch
    base_mode = ctl.model_state(model).mode
    ctl.apply(model, fat_plan(cores, B, None))
    bench.measure("fat-fp32-eager")
    outcome, during = bench.tune_under_load(rate, budget_s, modes)
    tuned_s = outcome.seconds
    bench.write({"kind": "tune", "model": model, "seconds": round(tuned_s, 1), "state": outcome.state,
                 "error": outcome.error, "tune": outcome.record.to_dict(), "load_during": during})
    errors = sum(d["errors"] for d in during)
    requests_during = sum(d["ok"] + d["errors"] for d in during)
    print(f"{model}: tuned in {tuned_s:.0f} s ({outcome.state}); {requests_during} requests during "
          f"tuning, {errors} failed", file=sys.stderr)
    tuned_plan = outcome.choice()
    if not outcome.ok or tuned_plan is None:
        print(outcome.error or "the tune chose no plan", file=sys.stderr)
        return
    bench.measure("tuned", {"tune_s": round(tuned_s, 1)})
    ctl.apply(model, fat_plan(cores, B, tuned_plan.mode))
    bench.measure("fat-tuned-mode")
    ctl.apply(model, tuned_plan)
    bench.measure("tuned", {"repeat": True})
    print(f"{model}: base mode {base_mode}", file=sys.stderr)


def bench_tuned(models: list[str], batch: int, requests: int, tune_budget_s: float | None, modes: list[str] | None,
                out: Path, rate_during_tune: float, command: str) -> str:
    """Every model in turn; writes <out>/results.jsonl and <out>/summary.md, returns the summary."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers we started (finally)
    from packrat.archive import ArchiveOptions, build_named
    from packrat.control import Controller, ControllerSettings
    from packrat.server import start_torchserve

    store = out / "model-store"
    store.mkdir(parents=True, exist_ok=True)
    results = open(out / "results.jsonl", "a")
    cores = sorted(os.sched_getaffinity(0))
    info = {"cpu": describe_machine().label, "cores": len(cores), "batch": batch, "loadavg": os.getloadavg(),
            "command": command, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    results.write(json.dumps({"kind": "run", **info}) + "\n")
    results.flush()
    print(f"# {info['cpu']}, {len(cores)} cores, B={batch}", file=sys.stderr)
    rows: list[dict] = []
    for model in models:
        build_named(model, store, model, ArchiveOptions(batch_size=1), reuse_current=True)
        body, ctype = sample_request(store / model)
        server = start_torchserve(store, out / f"torchserve-{model}",
                                  extra_properties={"token_expiration_min": "480"})
        try:
            server.register(model, 1)
            ctl = Controller(ControllerSettings(
                management_url=server.management_url, key_file=server.key_file, model_store=store,
                state_dir=out / f"state-{model}", cores=tuple(cores), metrics_url=server.metrics_url))
            url = f"{server.inference_url}/predictions/{model}"
            bench = _Bench(model, ctl, lambda: Target(url, body, ctype, server.keys.inference.key, timeout_s=600.0),
                           batch, requests, results, rows)
            _bench_model(bench, len(cores), rate_during_tune, tune_budget_s, modes)
        finally:
            server.stop()
    text = summary(info, rows, requests)
    (out / "summary.md").write_text(text + "\n")
    return text


def summary(info: dict, rows: list[dict], requests: int) -> str:
    lines = [f"CPU: {info['cpu']}, {info['cores']} cores; B = {info['batch']} closed-loop clients; "
             f"{requests} measured requests per point",
             "", "| model | config | mode | shape | p50 ms | p99 ms | req/s |", "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        ld = r["load"]
        lines.append(f"| {r['model']} | {r['config']}{' (repeat)' if r.get('repeat') else ''} | {r['mode']} | "
                     f"{shape(r['plan'])} | {ld['p50_ms']:.1f} | {ld['p99_ms']:.1f} | {ld['throughput_rps']:.2f} |")
    return "\n".join(lines)
