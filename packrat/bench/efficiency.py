"""Account for every millisecond (issue 35, item 1): one model, mode, plan and payload,
measured three ways side by side in one run, interleaved over R rounds:

    for each round:
        raw      the plan's workers as pinned profiler workers (packrat.profile.worker,
                 scope "model": the handler's own runner, forward only, inputs
                 preprocessed once), all of them at once on the plan's cores
        handler  the same workers, scope "handler": decode, preprocess, forward and
                 postprocess of the payload, in process
        served   C closed-loop clients (packrat.bench.loadgen) through a real TorchServe,
                 the plan live by the controller's live-plan swap (Controller.apply, as
                 packrat.bench.run does); CPU time of every process over the measured
                 window from /proc (packrat.bench.proc_cpu)
        peer     the same clients and window against the same archive served by one lean
                 peer server, LitServe (packrat.bench.peer; the bench-only `peer` extra),
                 one pinned worker per plan worker; skipped, once said, without litserve

Each figure is a throughput in items per second (a served request is one item; a raw
or handler call of batch b is b items), with p50/p99 (raw and handler: per batch call;
served and peer: per request) and CPU milliseconds per item. Rows go to <out>/results.jsonl as
they land; packrat.bench.efficiency_report reads only that file.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packrat.bench.loadgen import LoadResult, Target, window_closed_loop
from packrat.bench.results import ResultLog
from packrat.errors import ConfigError, ProfileError
from packrat.modes import ExecutionMode
from packrat.types import Plan

if TYPE_CHECKING:
    from packrat.bench.peer import PeerServer

# The profiler's stop rule made a fixed-duration one: a CI this narrow is never reached,
# so every point runs for its whole budget and the rounds stay comparable.
_FIXED_DURATION = {"rel_ci": 1e-6, "confidence": 0.95, "min_count": 5, "max_count": 10**7}
_SHAPE = re.compile(r"^\s*(\d+)\s*x\s*\(\s*(?:t(\d+)|(\d+)t)\s*,\s*b(\d+)\s*\)\s*$")


@dataclass(frozen=True)
class EfficiencySettings:
    model: str  # a named architecture (packrat.archive) or an archive directory
    out: Path
    mode: str = "fp32-eager"
    plan: str = "2x(t1,b4)"  # n x (threads, batch cap), "+"-joined for mixed thread counts
    clients: int | None = None  # None: the plan's load batch (sum of the caps)
    rounds: int = 3
    seconds: float = 10.0  # each raw and each handler point, warm-up included
    served_s: float = 20.0  # each served window
    warm_s: float = 60.0  # served load before the first round (TorchServe's JVM compiles its path)
    # ...and on, in JIT_CHUNK_S chunks, until the JVM's JIT compilers are quiet (Served.warm), at most this
    warm_max_s: float = 240.0
    rewarm_s: float = 3.0  # served load, not measured, before every round's window
    max_length: int | None = None  # text models: the payload's tokens (None: the archive's)
    controller_pid: int | None = None  # a running controller whose CPU to read too
    peer: bool = True  # the peer level too (LitServe, when installed)
    client: str = "lean"  # the served and peer levels' closed loop (packrat.bench.loadgen.CLIENTS)
    command: str = ""


def parse_plan(text: str) -> list[tuple[int, int]]:
    """"2x(t1,b4)" or "1x(t2,b4)+1x(t1,b4)" (also "2x(1t,b4)") -> [(threads, cap), ...]."""
    shape: list[tuple[int, int]] = []
    for part in text.split("+"):
        m = _SHAPE.match(part)
        if not m:
            raise ConfigError(f"plan {text!r}: each part must read like 2x(t1,b4)")
        n, threads, cap = int(m[1]), int(m[2] or m[3]), int(m[4])
        if min(n, threads, cap) < 1:
            raise ConfigError(f"plan {text!r}: counts must be >= 1")
        shape += [(threads, cap)] * n
    return shape


def core_blocks(shape: list[tuple[int, int]], cores: tuple[int, ...]) -> list[list[int]]:
    """Consecutive usable cores for each worker, as many as its threads."""
    need = sum(t for t, _ in shape)
    if need > len(cores):
        raise ConfigError(f"the plan needs {need} cores, this process may use {len(cores)}")
    blocks, at = [], 0
    for threads, _ in shape:
        blocks.append(list(cores[at:at + threads]))
        at += threads
    return blocks


# -- raw and handler: pinned profiler workers ---------------------------------------------


def time_in_process(archive_dir: Path, config: dict[str, Any], shape: list[tuple[int, int]],
                    blocks: list[list[int]], scope: str, seconds: float, log_path: Path) -> dict[str, Any]:
    """All of the plan's workers at once, each timing its batch cap for `seconds` in `scope`."""
    from packrat.profile.runner import run_worker

    rule = {**_FIXED_DURATION, "point_budget_s": seconds, "warmup_s": min(1.0, seconds / 4)}
    points: list[dict[str, Any] | None] = [None] * len(shape)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        threads, cap = shape[k]
        job = {"archive_dir": str(archive_dir), "config": config, "threads": threads, "cores": blocks[k],
               "batches": [cap], "scope": scope, "rule": rule, "budget_s": None}

        def on_event(event: dict[str, Any]) -> None:
            if event["event"] == "point":
                points[k] = event

        try:
            run_worker(job, on_event, log_path)
        except BaseException as exc:  # noqa: BLE001 - raised below, once every worker stopped
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(k,), name=f"efficiency-{scope}-{k}") for k in range(len(shape))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors or any(p is None for p in points):
        raise ProfileError(f"{scope}: a worker measured nothing: {errors[0] if errors else 'no point'}")
    return level_row([p for p in points if p is not None], blocks)


def level_row(points: list[dict[str, Any]], blocks: list[list[int]]) -> dict[str, Any]:
    """One level's figures from its workers' points: throughput summed (they ran at once),
    p50/p99 of the slowest, CPU per item from each worker's own process time."""
    instances, items_per_s, cpu_ms_per_s = [], 0.0, 0.0
    for p, cores in zip(points, blocks):
        meta = p["meta"]
        calls = p["count"] + meta["warmup_calls"]
        # cpu_share is process CPU / (wall x threads) over warm-up + measurement.
        cpu_ms_per_call = meta["cpu_share"] * p["threads"] * meta["elapsed_s"] * 1000.0 / calls
        items_per_s += p["batch"] * 1000.0 / p["mean_ms"]
        cpu_ms_per_s += cpu_ms_per_call * 1000.0 / p["mean_ms"]
        instances.append({"threads": p["threads"], "batch": p["batch"], "cores": cores, "pid": meta["pid"],
                          "mean_ms": p["mean_ms"], "p50_ms": p["p50_ms"], "p99_ms": p["p99_ms"],
                          "count": p["count"], "cpu_share": meta["cpu_share"],
                          "cpu_ms_per_call": round(cpu_ms_per_call, 3), "loadavg_1m": meta["loadavg_1m"]})
    return {"instances": instances, "items_per_s": round(items_per_s, 3),
            "p50_ms": max(i["p50_ms"] for i in instances), "p99_ms": max(i["p99_ms"] for i in instances),
            "cpu_ms_per_item": round(cpu_ms_per_s / items_per_s, 4)}


# -- served: TorchServe with the plan live -------------------------------------------------

# TorchServe's JVM compiles its request path with C2 for a minute or more of load (BERT-base
# short texts on the 2-core EPYC: its compiler threads used 0.05-0.07 of a core for the first
# ~75 s, the JVM as a whole 0.08-0.12 then 0.025-0.04 after). A server that has been up a while
# has done that once; the served windows measure it after, as the steady state it is.
JIT_CHUNK_S = 10.0
JIT_QUIET_CORES = 0.01  # the compilers' share of a core over a chunk below which the path counts as compiled
JVM_LABEL = "frontend JVM"  # processes()'s label for TorchServe's JVM, which measure() finds its JIT by


class Served:
    """A TorchServe of our own with `plan` live for the archive, and its processes by name."""

    def __init__(self, s: EfficiencySettings, archive_dir: Path, plan: Plan, body: bytes, ctype: str) -> None:
        from packrat.apply.swap import SwapSettings
        from packrat.bench.run import TOKEN_EXPIRATION_MIN
        from packrat.control import Controller, ControllerSettings
        from packrat.server import start_torchserve

        self.s, self.model, self.body, self.ctype = s, archive_dir.name, body, ctype
        self.server = start_torchserve(archive_dir.parent, s.out / "torchserve",
                                       extra_properties={"token_expiration_min": str(TOKEN_EXPIRATION_MIN)})
        try:
            self.ctl = Controller(ControllerSettings(
                management_url=self.server.management_url, key_file=self.server.key_file,
                model_store=archive_dir.parent, state_dir=s.out / "controller",
                metrics_url=self.server.metrics_url, swap=SwapSettings()))
            self.server.management_client().register(self.model, self.model, 1)
            self.swap = self.ctl.apply(self.model, plan)
        except BaseException:
            self.server.stop()
            raise

    def target(self) -> Target:
        # Keys are re-read every time: TorchServe may have rotated them.
        return Target(f"{self.server.inference_url}/predictions/{self.model}", self.body, self.ctype,
                      self.server.keys.inference.key, timeout_s=300.0)

    def load(self, seconds: float):
        return window_closed_loop(self.target(), self.clients, seconds, self.s.client)

    def jvm_pid(self) -> int | None:
        from packrat.bench.proc_cpu import comm, group_members

        return next((pid for pid in group_members(self.server.pid) if comm(pid) == "java"), None)

    def warm(self) -> dict[str, Any]:
        """Load for warm_s, then on in JIT_CHUNK_S chunks until the JVM's JIT compilers used
        less than JIT_QUIET_CORES of a core over one (or warm_max_s in all): what was done."""
        from packrat.bench.proc_cpu import jit_cpu_ticks, tick_ms

        jvm, started = self.jvm_pid(), time.monotonic()
        self.load(self.s.warm_s)
        chunks: list[float] = []
        while jvm is not None and time.monotonic() - started < self.s.warm_max_s:
            # The reads measure() makes between windows, before every chunk: the first
            # management and metrics calls after a warm-up of inference alone set the JIT
            # recompiling the inference path (measured on MiniLM: 0.000-0.003 -> 0.075 of a core
            # in the next window), so a quiet chunk counts only with them in it.
            self.reads_between_windows()
            before, t0 = jit_cpu_ticks(jvm), time.monotonic()
            self.load(min(JIT_CHUNK_S, max(1.0, self.s.warm_max_s - (t0 - started))))
            after, dt = jit_cpu_ticks(jvm), time.monotonic() - t0
            if before is None or after is None:
                break
            chunks.append(round(max(0, after - before) * tick_ms() / 1000.0 / dt, 4))
            if chunks[-1] < JIT_QUIET_CORES:
                break
        total = jit_cpu_ticks(jvm) if jvm is not None else None
        return {"warm_s": round(time.monotonic() - started, 1), "jit_cores_by_chunk": chunks, "reads_each_chunk": True,
                "jit_quiet": bool(chunks) and chunks[-1] < JIT_QUIET_CORES, "jit_quiet_cores": JIT_QUIET_CORES,
                # what the compiler threads alive now used since the JVM started (a lower bound)
                "jit_cpu_ms_since_start": None if total is None else round(total * tick_ms(), 1)}

    @property
    def clients(self) -> int:
        return self.s.clients or sum(cap for _, cap in parse_plan(self.s.plan))

    def processes(self) -> dict[int, str]:
        """pid -> label for every process that serves or sends: workers, the frontend JVM,
        the rest of TorchServe's process group, the controller if given, and this client."""
        from packrat.bench.proc_cpu import command_name, comm, controller_labels, group_members

        labels: dict[int, str] = {}
        workers = sorted(((w.check.cores if w.check else None) or (), int(w.described["pid"]))
                         for w in self.ctl.model_state(self.model).workers)
        for k, (cores, pid) in enumerate(workers, 1):
            labels[pid] = f"worker {k} (cores {','.join(map(str, cores)) or '?'})"
        for pid in group_members(self.server.pid):
            if pid not in labels:
                label = JVM_LABEL if comm(pid) == "java" else f"other in TorchServe's group: {command_name(pid)}"
                while label in labels.values():
                    label += "'"
                labels[pid] = label
        if self.s.controller_pid:
            labels.update(controller_labels(self.s.controller_pid))
        labels[os.getpid()] = "client (the load generator, this process)"
        return labels

    def reads_between_windows(self) -> tuple[Any, dict[int, str]]:
        """What a window needs read before it starts (TorchServe's metrics and its workers
        through the management API): the observation and the processes' labels."""
        return self.ctl.observe(self.model), self.processes()

    def measure(self) -> dict[str, Any]:
        """One served window: C clients for served_s, every process's CPU over it."""
        from packrat.bench.run import server_side

        from packrat.bench.proc_cpu import jit_cpu_ticks, tick_ms

        self.load(self.s.rewarm_s)
        obs0, labels = self.reads_between_windows()  # scrapes outside the CPU window
        jvm = next((pid for pid, label in labels.items() if label == JVM_LABEL), None)
        jit0 = jit_cpu_ticks(jvm) if jvm else None
        row = measure_window(self.load, labels, self.s.served_s, self.clients)
        jit1 = jit_cpu_ticks(jvm) if jvm else None
        obs1 = self.ctl.observe(self.model)
        # The JVM's JIT compilers within the JVM's own figure (a lower bound: proc_cpu.jit_cpu_ticks).
        jit = None if jit0 is None or jit1 is None else round(max(0, jit1 - jit0) * tick_ms() / max(1, row["requests"]), 4)
        return {**row, "server": server_side(obs0, obs1), "jvm_jit_ms_per_request": jit}

    def stop(self) -> None:
        self.server.stop()


def measure_window(load: Callable[[float], LoadResult], labels: dict[int, str], seconds: float,
                   clients: int) -> dict[str, Any]:
    """`load` for `seconds`, and the CPU time of every labelled process over that window."""
    from packrat.bench.proc_cpu import CpuWindow

    window = CpuWindow.start(labels)
    res = load(seconds)
    cpu = window.stop()
    sent = res.ok + res.errors
    for row in cpu.values():
        row["ms_per_request"] = None if row["cpu_ms"] is None else round(row["cpu_ms"] / max(1, sent), 4)
        row["cores"] = None if row["cpu_ms"] is None else round(row["cpu_ms"] / 1000.0 / res.duration_s, 3)
    known = [r["cpu_ms"] for r in cpu.values() if r["cpu_ms"] is not None]
    return {"clients": clients, "load": res.summary(), "requests": sent,
            "items_per_s": round(res.throughput_rps, 3), "p50_ms": res.p50_ms, "p99_ms": res.p99_ms,
            "cpu_ms_per_item": round(sum(known) / max(1, sent), 4), "cpu": cpu}


# -- peer: the same archive through LitServe ---------------------------------------------


def peer_skipped(s: EfficiencySettings) -> str | None:
    """Why this run has no peer level; None when it has one."""
    from packrat.bench.peer import peer_missing

    return "not asked for (--no-peer)" if not s.peer else peer_missing()


def start_peer(s: EfficiencySettings, archive_dir: Path, config: dict[str, Any], shape: list[tuple[int, int]],
               blocks: list[list[int]], request: tuple[bytes, str], clients: int, log: ResultLog) -> PeerServer:
    """The peer up, its start logged, warmed as long as the served level, then paused."""
    from importlib.metadata import version

    from packrat.bench.peer import BATCH_TIMEOUT_S, PeerServer

    t0 = time.monotonic()
    peer = PeerServer(archive_dir, config, shape, blocks, *request, s.out / "peer")
    try:
        log.append("peer_ready", {"server": f"litserve {version('litserve')}",
                                  "seconds": round(time.monotonic() - t0, 2), "pgid": peer.proc.pid,
                                  "batch_timeout_s": BATCH_TIMEOUT_S, "body": "the served body, base64 in JSON",
                                  "body_bytes": len(peer.body), "workers": peer.workers_seen()})
        peer.load(s.warm_s, clients, s.client)
        peer.pause()  # its idle workers poll their queue: kept out of the other levels' windows
    except BaseException:
        peer.stop()
        raise
    return peer


def measure_peer(peer: PeerServer, s: EfficiencySettings, clients: int) -> dict[str, Any]:
    """One peer window, as the served one: re-warm, then C clients for served_s with the CPU read."""
    peer.resume()
    try:
        peer.load(s.rewarm_s, clients, s.client)
        return measure_window(lambda seconds: peer.load(seconds, clients, s.client), peer.processes(), s.served_s,
                              clients)
    finally:
        peer.pause()


# -- the run ---------------------------------------------------------------------------


def prepare(s: EfficiencySettings, store: Path) -> Path:
    """The base archive in `store`: a named architecture built (max_length set), a directory copied."""
    from packrat.archive import ArchiveOptions, build_named

    src = Path(s.model)
    if src.is_dir():
        dest = store / src.name
        if not dest.exists():
            shutil.copytree(src, dest, symlinks=True)
        return dest
    name = s.model + (f"-{s.max_length}tok" if s.max_length else "")
    return Path(build_named(s.model, store, name, ArchiveOptions(max_length=s.max_length), reuse_current=True))


def run_efficiency(s: EfficiencySettings) -> Path:
    """The whole run; rows appended to <out>/results.jsonl, the summary to <out>/summary.md."""
    from packrat.bench.efficiency_report import last_run, summarise, write_summary
    from packrat.bench.machine import describe_machine
    from packrat.bench.run import machine_info, sample_request
    from packrat.cores import usable_cores
    from packrat.plan import plan_from_shape
    from packrat.profile import open_archive

    if s.rounds < 1 or min(s.seconds, s.served_s) <= 0:
        raise ConfigError("need rounds >= 1 and positive durations")
    s.out.mkdir(parents=True, exist_ok=True)
    shape = parse_plan(s.plan)
    cores = usable_cores().cores
    blocks = core_blocks(shape, cores)
    plan = replace(plan_from_shape(shape, len(cores), None), mode=str(ExecutionMode.parse(s.mode)))
    archive_dir = prepare(s, s.out / "model-store")
    config = ExecutionMode.parse(s.mode).in_config(open_archive(archive_dir).config)
    body, ctype = sample_request(archive_dir)
    log = ResultLog(s.out / "results.jsonl")
    skip_peer = peer_skipped(s)
    if skip_peer:
        print(f"the peer level is skipped: {skip_peer}", file=sys.stderr, flush=True)
    log.append("run", {"command": s.command, "machine": describe_machine().as_dict(), "versions": machine_info(),
                       "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(s).items()},
                       "archive": str(archive_dir), "payload_bytes": len(body), "content_type": ctype,
                       "cores": [list(b) for b in blocks], "peer_skipped": skip_peer})
    served = Served(s, archive_dir, plan, body, ctype)
    peer = None
    try:
        log.append("swap", {"to_version": served.swap.to_version, "seconds": served.swap.duration_s,
                            "torchserve_pgid": served.server.pid})
        log.append("warm", served.warm())
        if not skip_peer:
            peer = start_peer(s, archive_dir, config, shape, blocks, (body, ctype), served.clients, log)
        for r in range(1, s.rounds + 1):
            for scope, kind in (("model", "raw"), ("handler", "handler")):
                row = time_in_process(archive_dir, config, shape, blocks, scope, s.seconds,
                                      s.out / "workers.log")
                _say(log.append(kind, {"round": r, **row}))
            _say(log.append("served", {"round": r, **served.measure()}))
            if peer:
                _say(log.append("peer", {"round": r, **measure_peer(peer, s, served.clients)}))
    finally:
        if peer:
            peer.stop()
        served.stop()
    log.append("summary", summarise(last_run(log.path)))
    return write_summary(log.path, s.out / "summary.md")


def _say(row: dict[str, Any]) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] round {row['round']} {row['kind']:<8} {row['items_per_s']:9.1f} items/s"
          f"  p50 {row['p50_ms']:8.2f} ms  p99 {row['p99_ms']:8.2f} ms  CPU {row['cpu_ms_per_item']:.3f} ms/item",
          file=sys.stderr, flush=True)
