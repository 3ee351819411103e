"""Two models under load at once on one machine: each planned for all cores (before cores
were divided among models) against the joint division (packrat.plan.share), side by side.

    python scripts/bench_two_models.py --models resnet50,bert-base --clients 4 --out bench-out/two-models

Both models (full-size architectures, seeded weights, fp32 eager, built as `make run`
builds them) run on one TorchServe (token auth on). Each round applies one
configuration to both models, then sends `--clients` closed-loop keep-alive clients to
each model at the same time for `--seconds` and records each model's p50/p99 and
throughput. Configurations, repeated `--rounds` times, in this order in even rounds and
in reverse in odd ones (so drift on a shared machine hits all of them alike):

  stacked-fat    each model 1 x (T threads, cap B) on every core: what a model planned
                 for all cores gets when its profile favours fat (both share every core)
  stacked-thin   each model T x (1 thread, cap ceil(B/T)) laid out from core 0: thin
                 plans of two models on the same cores
  divided        the division of cores when both have load: cores split between them
                 (on 2 cores one each), each model 1 x (its cores, cap B) on its own

The worst model's p50 per configuration is what the issue's target compares
(divided >= 1.5x better than the stacked plans). One JSON object per line in
<out>/results.jsonl; a markdown summary in <out>/summary.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

from packrat.bench.loadgen import Target, closed_loop
from packrat.bench.run import sample_request
from packrat.bench.machine import describe_machine
from packrat.types import Instance, Plan



def uniform(n: int, threads: int, cap: int, cores: int) -> Plan:
    return Plan(cores=cores, batch=n * cap, instances=(Instance(threads, cap, 0.0),) * n, predicted_latency_ms=0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--clients", type=int, default=4, help="closed-loop clients per model (B)")
    ap.add_argument("--seconds", type=float, default=40.0, help="measured seconds per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench-out/two-models"))
    args = ap.parse_args()
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server we started (finally)

    from packrat.apply.client import ManagementClient
    from packrat.apply.swap import Swapper
    from packrat.archive import ArchiveOptions, build_named
    from packrat.cores import usable_cores
    from packrat.plan.share import Demand, divide_cores
    from packrat.server import start_torchserve

    models = [m for m in args.models.split(",") if m]
    if len(models) != 2:
        raise SystemExit("give two models")
    out = args.out
    store = out / "model-store"
    store.mkdir(parents=True, exist_ok=True)
    cores = list(usable_cores().cores)
    T, B = len(cores), args.clients
    info = {"cpu": describe_machine().cpu, "cores": T, "clients_per_model": B, "seconds": args.seconds,
            "loadavg_start": os.getloadavg(), "command": " ".join(sys.argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    results = open(out / "results.jsonl", "a")
    results.write(json.dumps({"kind": "run", **info}) + "\n")
    print(f"# {info['cpu']}, {T} cores, {B} clients per model", file=sys.stderr)

    for m in models:
        build_named(m, store, m, ArchiveOptions(batch_size=1), reuse_current=True)
    server = start_torchserve(store, out / "torchserve", slot_dir=out / "slots",
                              extra_properties={"token_expiration_min": "480"})
    os.environ["PACKRAT_SLOT_DIR"] = str(server.slot_dir)  # the swapper reads the workers' status files
    rows: list[dict] = []
    try:
        for m in models:
            server.register(m, 1)
        client = ManagementClient(server.management_url, server.key_file)
        swapper = Swapper(client, store, cores)
        # The division with both loaded (equal weights; the split does not depend on the
        # latencies when there are as many cores as models, as on 2 cores).
        division = divide_cores([Demand(m, B, lambda c: 1.0 / c) for m in models], cores)
        thin_cap = math.ceil(B / T)
        configs = {
            "stacked-fat": {m: (uniform(1, T, B, T), cores) for m in models},
            "stacked-thin": {m: (uniform(T, 1, thin_cap, T), cores) for m in models},
            "divided": {m: (uniform(1, len(division.shares[m]), B, len(division.shares[m])),
                            list(division.shares[m])) for m in models},
        }
        bodies = {m: sample_request(store / m) for m in models}
        for rnd in range(args.rounds):
            # Odd rounds run the configurations in reverse: a load that drifts over the run
            # (a shared machine) then favours none of them on average.
            order = list(configs.items()) if rnd % 2 == 0 else list(configs.items())[::-1]
            for name, per_model in order:
                for m, (plan, on) in per_model.items():
                    swapper.apply(m, plan, cores=on)
                results_by_model: dict[str, dict] = {}

                def run(m: str) -> None:
                    body, ctype = bodies[m]
                    t = Target(f"{server.inference_url}/predictions/{m}", body, ctype,
                               server.keys.inference.key, timeout_s=600.0)
                    res = closed_loop(t, B, 100_000, warmup=2 * B, max_duration_s=args.seconds)
                    results_by_model[m] = res.summary()

                threads = [threading.Thread(target=run, args=(m,)) for m in models]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                rec = {"kind": "round", "round": rnd, "config": name, "loadavg": os.getloadavg(),
                       "plans": {m: {"shape": [list(s) for s in p.shape], "cores": on}
                                 for m, (p, on) in per_model.items()},
                       "load": results_by_model}
                results.write(json.dumps(rec) + "\n")
                results.flush()
                rows.append(rec)
                print(f"round {rnd} {name:<13} " + "  ".join(
                    f"{m}: p50 {results_by_model[m]['p50_ms']:.0f} ms {results_by_model[m]['throughput_rps']:.2f} req/s "
                    f"err {results_by_model[m]['errors']}" for m in models) + f"  load {os.getloadavg()[0]:.1f}",
                    file=sys.stderr)
    finally:
        server.stop()

    lines = [f"CPU: {info['cpu']}, {T} cores; {B} closed-loop clients per model, both models at once; "
             f"{args.seconds:.0f} s per round; load average at start {info['loadavg_start'][0]:.2f}",
             "", "| round | config | " + " | ".join(f"{m} p50 ms | {m} req/s" for m in models)
             + " | worst p50 ms | errors | load avg |",
             "|---|---|" + "---:|---:|" * len(models) + "---:|---:|---:|"]
    worst: dict[str, list[float]] = {}
    for r in rows:
        ld = r["load"]
        w = max(ld[m]["p50_ms"] for m in models)
        worst.setdefault(r["config"], []).append(w)
        lines.append(f"| {r['round']} | {r['config']} | " + " | ".join(
            f"{ld[m]['p50_ms']:.1f} | {ld[m]['throughput_rps']:.2f}" for m in models)
            + f" | {w:.1f} | {sum(ld[m]['errors'] for m in models)} | {r['loadavg'][0]:.1f} |")
    lines.append("")
    best_stacked = min(sum(v) / len(v) for k, v in worst.items() if k.startswith("stacked"))
    divided = sum(worst["divided"]) / len(worst["divided"])
    lines.append("Worst-model p50, mean over rounds: " + ", ".join(
        f"{k} {sum(v) / len(v):.1f} ms" for k, v in worst.items())
        + f". Divided vs the better stacked configuration: {best_stacked / divided:.2f}x.")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
