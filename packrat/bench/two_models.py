"""Two models under load at once on one machine: each planned for all cores against the
joint division of cores (packrat.plan.share), side by side (scripts/bench_two_models.py
says what each configuration is). One JSON object per line in <out>/results.jsonl;
summary() renders the markdown.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

from packrat.bench.loadgen import Target, closed_loop
from packrat.bench.machine import describe_machine
from packrat.bench.run import sample_request
from packrat.server import RunningServer
from packrat.types import Instance, Plan
from packrat import settings

Configs = dict[str, dict[str, tuple[Plan, list[int]]]]  # config -> model -> (plan, cores)


def uniform(n: int, threads: int, cap: int, cores: int) -> Plan:
    return Plan(cores=cores, batch=n * cap, instances=(Instance(threads, cap, 0.0),) * n, predicted_latency_ms=0.0)


def configurations(models: list[str], cores: list[int], clients: int) -> Configs:
    """stacked-fat, stacked-thin and divided, for every model."""
    from packrat.plan.share import Demand, divide_cores

    T, B = len(cores), clients
    # The division with both loaded (equal weights; the split does not depend on the
    # latencies when there are as many cores as models, as on 2 cores).
    division = divide_cores([Demand(m, B, lambda c: 1.0 / c) for m in models], cores)
    thin_cap = math.ceil(B / T)
    return {
        "stacked-fat": {m: (uniform(1, T, B, T), cores) for m in models},
        "stacked-thin": {m: (uniform(T, 1, thin_cap, T), cores) for m in models},
        "divided": {m: (uniform(1, len(division.shares[m]), B, len(division.shares[m])),
                        list(division.shares[m])) for m in models},
    }


def _load_both(server: RunningServer, bodies: dict[str, tuple[bytes, str]], clients: int,
               seconds: float) -> dict[str, dict]:
    """`clients` closed-loop clients to each model at the same time for `seconds`."""
    results_by_model: dict[str, dict] = {}

    def run(m: str) -> None:
        body, ctype = bodies[m]
        t = Target(f"{server.inference_url}/predictions/{m}", body, ctype,
                   server.keys.inference.key, timeout_s=600.0)
        res = closed_loop(t, clients, 100_000, warmup=2 * clients, max_duration_s=seconds)
        results_by_model[m] = res.summary()

    threads = [threading.Thread(target=run, args=(m,)) for m in bodies]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results_by_model


def bench_two_models(models: list[str], clients: int, seconds: float, rounds: int, out: Path,
                     command: str) -> str:
    """The rounds; writes <out>/results.jsonl and <out>/summary.md, returns the summary."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server we started (finally)
    from packrat.apply.client import ManagementClient
    from packrat.apply.swap import Swapper
    from packrat.archive import ArchiveOptions, build_named
    from packrat.cores import usable_cores
    from packrat.server import start_torchserve

    store = out / "model-store"
    store.mkdir(parents=True, exist_ok=True)
    cores = list(usable_cores().cores)
    info = {"cpu": describe_machine().label, "cores": len(cores), "clients_per_model": clients, "seconds": seconds,
            "loadavg_start": os.getloadavg(), "command": command,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    results = open(out / "results.jsonl", "a")
    results.write(json.dumps({"kind": "run", **info}) + "\n")
    print(f"# {info['cpu']}, {len(cores)} cores, {clients} clients per model", file=sys.stderr)
    for m in models:
        build_named(m, store, m, ArchiveOptions(batch_size=1), reuse_current=True)
    server = start_torchserve(store, out / "torchserve", slot_dir=out / "slots",
                              extra_properties={"token_expiration_min": "480"})
    os.environ[settings.get("slot_dir").env] = str(server.slot_dir)  # the swapper reads the workers' status files
    rows: list[dict] = []
    try:
        for m in models:
            server.register(m, 1)
        swapper = Swapper(ManagementClient(server.management_url, server.key_file), store, cores)
        configs = configurations(models, cores, clients)
        bodies = {m: sample_request(store / m) for m in models}
        for rnd in range(rounds):
            # Odd rounds run the configurations in reverse: a load that drifts over the run
            # (a shared machine) then favours none of them on average.
            order = list(configs.items()) if rnd % 2 == 0 else list(configs.items())[::-1]
            for name, per_model in order:
                for m, (plan, on) in per_model.items():
                    swapper.apply(m, plan, cores=on)
                loads = _load_both(server, bodies, clients, seconds)
                rec = {"kind": "round", "round": rnd, "config": name, "loadavg": os.getloadavg(),
                       "plans": {m: {"shape": [list(s) for s in p.shape], "cores": on}
                                 for m, (p, on) in per_model.items()},
                       "load": loads}
                results.write(json.dumps(rec) + "\n")
                results.flush()
                rows.append(rec)
                print(f"round {rnd} {name:<13} " + "  ".join(
                    f"{m}: p50 {loads[m]['p50_ms']:.0f} ms {loads[m]['throughput_rps']:.2f} req/s "
                    f"err {loads[m]['errors']}" for m in models) + f"  load {os.getloadavg()[0]:.1f}",
                    file=sys.stderr)
    finally:
        server.stop()
    text = summary(info, models, rows)
    (out / "summary.md").write_text(text + "\n")
    return text


def summary(info: dict, models: list[str], rows: list[dict]) -> str:
    lines = [f"CPU: {info['cpu']}, {info['cores']} cores; {info['clients_per_model']} closed-loop clients per "
             f"model, both models at once; {info['seconds']:.0f} s per round; load average at start "
             f"{info['loadavg_start'][0]:.2f}",
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
    return "\n".join(lines)
