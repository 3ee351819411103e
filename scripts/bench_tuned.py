"""Tuned vs fat fp32-eager through TorchServe: the mode's gain and the shape's, in one run.

    python scripts/bench_tuned.py --models resnet50,bert-base --batch 8 --out bench-out/tuned

For each model (full-size architecture, seeded weights, built as `make run` builds it:
fp32 eager, batch 1) on its own TorchServe (token auth on) and an in-process
Packrat controller:

  1. fat-fp32-eager   1 worker, T threads, batch cap B, the archive's own mode
  2. tune             Controller.start_tune(batch=B): probe, guard + profile every
                      candidate mode, apply the best (mode, plan); timed from start
                      to applied, while requests keep arriving (--rate-during-tune,
                      every answer counted: failures during tuning are reported)
  3. tuned            what the tune made live
  4. fat-tuned-mode   1 worker, T threads, batch cap B, in the tuned mode
  5. tuned (again)    the repeat gives the run's noise band

each measured with B closed-loop keep-alive clients. One JSON object per line
in <out>/results.jsonl; a markdown summary is printed (and written to
<out>/summary.md).

`packrat bench --tuned` measures the same split (fat-tuned, tuned) at every B
of its run, beside fat, packrat, the oracle and the defaults
(docs/benchmarks.md); this script adds the load sent while tuning. Both use
packrat.bench.tuned (fat_plan, run_tune).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import urllib3

from packrat.bench.loadgen import Connection, Target, closed_loop
from packrat.bench.machine import describe_machine
from packrat.bench.run import sample_request
from packrat.bench.tuned import fat_plan as fat
from packrat.bench.tuned import run_tune
from packrat.types import Plan


def shape(plan: dict | None) -> str:
    if not plan:
        return "-"
    groups: dict = {}
    for i in plan["instances"]:
        groups[(i["threads"], i["batch"])] = groups.get((i["threads"], i["batch"]), 0) + 1
    return " + ".join(f"{n}x(t{t},b{b})" for (t, b), n in groups.items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--requests", type=int, default=80, help="measured requests per point")
    ap.add_argument("--tune-budget", type=float, default=None, help="seconds per model tune [tune's default]")
    ap.add_argument("--modes", default="", help="comma-separated modes to try [tune's short list]")
    ap.add_argument("--out", type=Path, default=Path("bench-out/tuned"))
    ap.add_argument("--rate-during-tune", type=float, default=1.0, help="requests/s sent while tuning")
    args = ap.parse_args()
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers we started (finally)

    from packrat.archive import ArchiveOptions, build_named
    from packrat.control import Controller, ControllerSettings
    from packrat.server import start_torchserve

    out = args.out
    store = out / "model-store"
    store.mkdir(parents=True, exist_ok=True)
    results = open(out / "results.jsonl", "a")
    cores = sorted(os.sched_getaffinity(0))
    T, B = len(cores), args.batch
    info = {"cpu": describe_machine().cpu, "cores": T, "batch": B, "loadavg": os.getloadavg(),
            "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    results.write(json.dumps({"kind": "run", **info}) + "\n")
    results.flush()
    print(f"# {info['cpu']}, {T} cores, B={B}", file=sys.stderr)
    rows = []

    for model in [m for m in args.models.split(",") if m]:
        build_named(model, store, model, ArchiveOptions(batch_size=1), reuse_current=True)
        body, ctype = sample_request(store / model)
        server = start_torchserve(store, out / f"torchserve-{model}",
                                  extra_properties={"token_expiration_min": "480"})
        try:
            server.register(model, 1)
            ctl = Controller(ControllerSettings(
                management_url=server.management_url, key_file=server.key_file, model_store=store,
                state_dir=out / f"state-{model}", cores=tuple(cores), metrics_url=server.metrics_url))

            def target() -> Target:
                return Target(f"{server.inference_url}/predictions/{model}", body, ctype,
                              server.keys.inference.key, timeout_s=600.0)

            def measure(config: str, extra: dict | None = None) -> dict:
                res = closed_loop(target(), B, args.requests, warmup=3 * B, max_duration_s=600.0)
                st = ctl.model_state(model)
                rec = {"kind": "point", "model": model, "config": config, "mode": st.mode,
                       "plan": st.plan.to_dict() if st.plan else None, "load": res.summary(),
                       "loadavg": os.getloadavg(), **(extra or {})}
                results.write(json.dumps(rec) + "\n")
                results.flush()
                print(f"{model} {config:<16} {st.mode:<18} {shape(rec['plan']):<18} p50 {res.p50_ms:8.1f} ms "
                      f"{res.throughput_rps:6.2f} req/s errors {res.errors}", file=sys.stderr)
                rows.append(rec)
                return rec

            base_mode = ctl.model_state(model).mode
            ctl.apply(model, fat(T, B, None))
            measure("fat-fp32-eager")

            # Tune while requests keep arriving (a light open load: every answer is checked,
            # but it must not drown the profiles it is measuring on the same 2 cores).
            stop = threading.Event()
            during: list = []

            def keep_loading() -> None:
                t = target()
                conn = Connection(t.url, t.timeout_s)
                while not stop.wait(1.0 / args.rate_during_tune):
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
                outcome = run_tune(ctl, model, batch=B, budget_s=args.tune_budget,
                                   modes=[m for m in args.modes.split(",") if m] or None,
                                   on_progress=lambda text: print(f"  [{time.monotonic() - t0:6.1f} s] {text}",
                                                                  file=sys.stderr))
            finally:
                stop.set()
                loader.join()
            tuned_s = outcome.seconds
            tune = outcome.record
            results.write(json.dumps({"kind": "tune", "model": model, "seconds": round(tuned_s, 1),
                                      "state": outcome.state, "error": outcome.error, "tune": tune,
                                      "load_during": during}) + "\n")
            results.flush()
            errors = sum(d["errors"] for d in during)
            requests_during = sum(d["ok"] + d["errors"] for d in during)
            print(f"{model}: tuned in {tuned_s:.0f} s ({outcome.state}); {requests_during} requests during "
                  f"tuning, {errors} failed", file=sys.stderr)
            if not outcome.ok:
                print(outcome.error, file=sys.stderr)
                continue
            tuned_plan = Plan.from_dict(tune["choice"])
            measure("tuned", {"tune_s": round(tuned_s, 1)})
            ctl.apply(model, fat(T, B, tuned_plan.mode))
            measure("fat-tuned-mode")
            ctl.apply(model, tuned_plan)
            measure("tuned", {"repeat": True})
            print(f"{model}: base mode {base_mode}", file=sys.stderr)
        finally:
            server.stop()

    lines = [f"CPU: {info['cpu']}, {T} cores; B = {B} closed-loop clients; {args.requests} measured requests per point",
             "", "| model | config | mode | shape | p50 ms | p99 ms | req/s |", "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        ld = r["load"]
        lines.append(f"| {r['model']} | {r['config']}{' (repeat)' if r.get('repeat') else ''} | {r['mode']} | "
                     f"{shape(r['plan'])} | {ld['p50_ms']:.1f} | {ld['p99_ms']:.1f} | {ld['throughput_rps']:.2f} |")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
