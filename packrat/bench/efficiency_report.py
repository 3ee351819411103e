"""The efficiency benchmark's figures and markdown, read only from its results.jsonl
(packrat.bench.efficiency writes it).

Each level's figure is the median over the rounds; a ratio is the quotient of two such
medians (served / handler, handler / raw, served / raw, served / peer), so it can be
recomputed from the rows. The CPU tables are the median over the rounds of each process's
CPU time per request, served and (when the run had it) peer.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from packrat.bench.results import read_records

LEVELS = ("raw", "handler", "served", "peer")
RATIOS = (("served", "handler"), ("handler", "raw"), ("served", "raw"), ("served", "peer"))
_FIGURES = ("items_per_s", "p50_ms", "p99_ms", "cpu_ms_per_item")


def last_run(path: Path) -> list[dict[str, Any]]:
    """The rows of the file's last run (rows carry their run's id)."""
    rows = list(read_records(path))
    runs = [r["run_id"] for r in rows if r["kind"] == "run"]
    return [r for r in rows if runs and r["run_id"] == runs[-1]]


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """{"levels": {level: figures}, "ratios": {"served/handler": x, ...}, "cpu": {process: ms/request},
    "peer_cpu": the same for the peer's processes}."""
    levels = {}
    for level in LEVELS:
        rs = [r for r in rows if r["kind"] == level]
        levels[level] = {"rounds": len(rs), **{f: _median([r.get(f) for r in rs]) for f in _FIGURES}}
    ratios = {}
    for a, b in RATIOS:
        ratios[f"{a}/{b}"] = _ratio(levels[a]["items_per_s"], levels[b]["items_per_s"])
    return {"levels": levels, "ratios": ratios, "cpu": _cpu_medians([r for r in rows if r["kind"] == "served"]),
            "peer_cpu": _cpu_medians([r for r in rows if r["kind"] == "peer"])}


def _cpu_medians(windows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """process label -> its pid and the median over the windows of its CPU per request and cores busy."""
    labels = list(dict.fromkeys(label for r in windows for label in r["cpu"]))
    return {label: {"pid": windows[-1]["cpu"].get(label, {}).get("pid"),
                    "ms_per_request": _median([r["cpu"].get(label, {}).get("ms_per_request") for r in windows]),
                    "cores": _median([r["cpu"].get(label, {}).get("cores") for r in windows])}
            for label in labels}


def _f(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def render(rows: list[dict[str, Any]]) -> str:
    run = next(r for r in rows if r["kind"] == "run")
    s, m, summ = run["settings"], run["machine"], summarise(rows)
    lv, served = summ["levels"], [r for r in rows if r["kind"] == "served"]
    clients = served[0]["clients"] if served else s.get("clients")
    # Runs before the lean client existed sent with urllib3, a thread per client.
    client = {"lean": "lean (one thread, raw keep-alive sockets)",
              "urllib3": "urllib3 (a thread per client)"}.get(s.get("client", "urllib3"), s.get("client"))
    lines = [
        f"# Efficiency: {Path(s['model']).name}, {s['mode']} {s['plan']}, {clients} clients",
        "",
        f"CPU: **{m.get('label', m['cpu'])}** ({m['cores']} usable cores of {m['cpus']}; flags {', '.join(m['flags']) or 'none'}; "
        f"{m['memory_gib']} GiB); torch {run['versions'].get('torch')}, TorchServe "
        f"{run['versions'].get('torchserve')}, Python {m['python']}; load average at start "
        f"{run['versions'].get('loadavg_at_start')}. Payload: {run['payload_bytes']} bytes ({run['content_type']}).",
        "",
        f"Command: `{run['command']}`. Client (served and peer levels): {client}.",
        "",
        *_warm_lines(rows),
        f"{lv['served']['rounds']} rounds, interleaved ({', '.join(k for k in LEVELS if lv[k]['rounds'])} in each). "
        "Figures: medians over the rounds. Raw and handler p50/p99 are per batch call of the plan's cap (the "
        "slowest worker's); served and peer p50/p99 per request.",
        "",
        "| level | what is timed | items/s | p50 ms | p99 ms | CPU ms / item |",
        "|---|---|---:|---:|---:|---:|",
    ]
    what = {"raw": "the runtime alone: forward on inputs preprocessed once, pinned workers of the plan",
            "handler": "decode, preprocess, forward, postprocess of the payload, the same workers",
            "served": f"through TorchServe, the plan live, {clients} closed-loop clients",
            "peer": _peer_what(rows, clients)}
    for level in LEVELS:
        f = lv[level]
        if level == "peer" and not f["rounds"]:
            lines.append(f"| peer | {what['peer']} | | | | |")
            continue
        lines.append(f"| {level} | {what[level]} | {_f(f['items_per_s'], 1)} | {_f(f['p50_ms'])} | "
                     f"{_f(f['p99_ms'])} | {_f(f['cpu_ms_per_item'], 3)} |")
    lines += ["", "Ratios (of throughput): " + "; ".join(f"**{k} = {_f(v, 3)}**" for k, v in summ["ratios"].items()),
              "", *_rounds(rows), "", *_cpu_table(summ, lv)]
    return "\n".join(lines) + "\n"


# Runs since the warm-up made the windows' management and metrics reads before each chunk.
READS = ", each after the reads made before a window (metrics, the workers)"


def _warm_lines(rows: list[dict[str, Any]]) -> list[str]:
    """How long the served level was loaded before its first window, and the JVM's JIT then
    and in the windows; nothing for runs from before the warm-up followed the JIT."""
    warm = next((r for r in rows if r["kind"] == "warm"), None)
    if warm is None:
        return []
    s = next(r for r in rows if r["kind"] == "run")["settings"]
    chunks = ", ".join(f"{c:g}" for c in warm["jit_cores_by_chunk"]) or "none measured"
    state = (f"quiet (below {warm['jit_quiet_cores']:g})" if warm["jit_quiet"]
             else f"**not quiet: the windows include JIT compiling** (not below {warm['jit_quiet_cores']:g})")
    jit = _median([r.get("jvm_jit_ms_per_request") for r in rows if r["kind"] == "served"])
    return [f"Served warm-up: {warm['warm_s']:g} s of load before the first round ({s.get('warm_s'):g} s, then "
            f"on in 10 s chunks{READS if warm.get('reads_each_chunk') else ''} until the frontend JVM's JIT "
            "compilers, its C1 and C2 threads, use less than "
            f"{warm['jit_quiet_cores']:g} of a core over one, at most {s.get('warm_max_s'):g} s). Their share of a "
            f"core in each chunk: {chunks}; {state}. In the served windows they used {_f(jit, 3)} ms of CPU a "
            "request (within the frontend JVM's figure below).", ""]


def _peer_what(rows: list[dict[str, Any]], clients: int | None) -> str:
    ready = next((r for r in rows if r["kind"] == "peer_ready"), None)
    if ready is None:
        run = next(r for r in rows if r["kind"] == "run")
        return f"skipped: {run.get('peer_skipped') or 'no peer rows'}"
    return (f"the same archive through {ready['server']}: one pinned worker per plan worker, batch up to the cap "
            f"within {ready['batch_timeout_s'] * 1000:g} ms, {ready['body']}, {clients} closed-loop clients")


def _rounds(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| round | raw items/s | handler items/s | served items/s | served p50 ms | served / raw "
           "| served / handler | peer items/s | served / peer |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted({row["round"] for row in rows if "round" in row}):
        got = {row["kind"]: row for row in rows if row.get("round") == r}
        fig = {k: got[k]["items_per_s"] if k in got else None for k in LEVELS}
        out.append(f"| {r} | {_f(fig['raw'], 1)} | {_f(fig['handler'], 1)} | {_f(fig['served'], 1)} | "
                   f"{_f(got.get('served', {}).get('p50_ms'))} | {_f(_ratio(fig['served'], fig['raw']), 3)} | "
                   f"{_f(_ratio(fig['served'], fig['handler']), 3)} | "
                   f"{_f(fig['peer'], 1)} | {_f(_ratio(fig['served'], fig['peer']), 3)} |")
    return out


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def _cpu_table(summ: dict[str, Any], lv: dict[str, Any]) -> list[str]:
    out = ["CPU time per served request of every process over the measured windows (/proc/<pid>/stat, "
           "utime + stime of all its threads; a controller is listed only when one was running):", "",
           "| process | pid | CPU ms / request | cores busy |", "|---|---:|---:|---:|"]
    for label, row in sorted(summ["cpu"].items(), key=lambda kv: _rank(kv[0])):
        out.append(f"| {label} | {row['pid']} | {_f(row['ms_per_request'], 3)} | {_f(row['cores'])} |")
    if "controller" not in summ["cpu"]:
        out.append("| controller | | not running (the plan applied by this process's Controller, no loop) | |")
    out += [f"| **all of the above** (median of the rounds' sums) | | **{_f(lv['served']['cpu_ms_per_item'], 3)}** | |",
            f"| in process, handler path (per item) | | {_f(lv['handler']['cpu_ms_per_item'], 3)} | |",
            f"| in process, runtime alone (per item) | | {_f(lv['raw']['cpu_ms_per_item'], 3)} | |"]
    if summ["peer_cpu"]:
        out += ["", "The same for the peer's windows (LitServe's processes and the client), per peer request:", "",
                "| process | pid | CPU ms / request | cores busy |", "|---|---:|---:|---:|"]
        out += [f"| {label} | {row['pid']} | {_f(row['ms_per_request'], 3)} | {_f(row['cores'])} |"
                for label, row in sorted(summ["peer_cpu"].items(), key=lambda kv: _rank(kv[0]))]
        out.append(f"| **all of the above** (median of the rounds' sums) | | "
                   f"**{_f(lv['peer']['cpu_ms_per_item'], 3)}** | |")
    return out


def _rank(label: str) -> tuple[int, str]:
    """Workers first, then the frontend, the rest of TorchServe, the controller, the client
    (the peer's: its workers, HTTP servers, queue, main process, the rest, the client)."""
    order = ("worker", "frontend", "other", "controller", "peer worker", "peer HTTP", "peer request", "peer main",
             "peer other", "client")
    return next((k for k, p in enumerate(order) if label.startswith(p)), len(order)), label


def write_summary(results: Path, out: Path) -> Path:
    rows = last_run(results)
    out.write_text(render(rows))
    return out
