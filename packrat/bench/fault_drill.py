"""Faults under load on a running `make run` (scripts/drill_faults.py): the fork server and
the controller killed with SIGKILL while clients keep sending, then a swap.

While `clients` closed-loop clients send one payload to `model`, the fork server beside
TorchServe is killed at `forkserver_kill_at` s and the controller (the child of
`packrat controller --restart-on-crash`, whose pid make run keeps) at `controller_kill_at`
s. Afterwards one plan is applied to `swap_model` through the restarted controller: its
new workers show whether the new fork server forks them warm. Reported: every request's
outcome (a status or an exception) and latency, the model's worker pids before and after,
and how long each part took to come back.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packrat.apply.client import ManagementClient, session_for
from packrat.bench.machine import describe_machine
from packrat.bench.proc_cpu import children_of, comm, command_name, group_members
from packrat.server import RunningServer


@dataclass(frozen=True)
class Drill:
    workdir: Path  # make run's TorchServe workdir (.packrat/torchserve)
    controller_pid_file: Path  # .packrat/controller.pid: the --restart-on-crash parent
    controller_url: str  # .packrat/controller.url
    model: str
    payload: bytes
    content_type: str
    swap_model: str = "noop"
    swap_plan: tuple[dict[str, int], ...] = ({"threads": 1, "batch": 1},)
    clients: int = 4
    seconds: float = 40.0
    forkserver_kill_at: float = 10.0
    controller_kill_at: float = 20.0
    # TorchServe's frontend (the JVM) too, at this many seconds (None: not): its requests in
    # flight fail and it is started again; the report says when it served again, and when the
    # controller had applied the model's last plan again.
    frontend_kill_at: float | None = None
    command: str = ""


@dataclass
class _Outcomes:
    started: float = field(default_factory=time.monotonic)
    rows: list[tuple[float, str, float]] = field(default_factory=list)  # (t, outcome, latency ms)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, t0: float, outcome: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.rows.append((round(t0 - self.started, 3), outcome, round((now - t0) * 1000, 2)))


def _client(d: Drill, server: RunningServer, out: _Outcomes, until: float) -> None:
    url = f"{server.inference_url}/predictions/{d.model}"
    headers = {**server.inference_headers(), "Content-Type": d.content_type}
    with session_for(url) as session:
        while time.monotonic() < until:
            t0 = time.monotonic()
            try:
                outcome = str(session.post(url, data=d.payload, headers=headers, timeout=120).status_code)
            except Exception as exc:  # noqa: BLE001 - every failure is a row of the report
                outcome = type(exc).__name__
            out.add(t0, outcome)
            if outcome != "200":
                time.sleep(0.05)  # a frontend that is down refuses at once: do not spin
                try:  # a restarted frontend made new keys (0.12 answers a stale one with 400)
                    headers = {**server.inference_headers(), "Content-Type": d.content_type}
                except Exception:  # noqa: BLE001 - its key file is not written yet
                    pass


def fork_servers(launcher: int) -> set[int]:
    """The fork servers TorchServe's launcher (packrat-torchserve) runs: its children running one."""
    return {pid for pid in children_of(launcher) if command_name(pid) == "packrat.forkserver.server"}


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _seconds_until(test: Any, timeout_s: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if test():
            return round(time.monotonic() - started, 2)
        time.sleep(0.05)
    return None


def _one(found: list[int] | set[int], what: str) -> int:
    if len(found) != 1:
        raise RuntimeError(f"found {len(found)} {what} ({sorted(found)}), not one")
    return next(iter(found))


def _kill_fork_server(server: RunningServer, check_only: bool = False) -> dict[str, Any]:
    killed = _one(fork_servers(server.pid), f"fork servers beside TorchServe pid {server.pid} "
                  "(started by packrat-torchserve, PACKRAT_FORKSERVER on)")
    if check_only:
        return {}
    os.kill(killed, signal.SIGKILL)
    back = _seconds_until(lambda: fork_servers(server.pid) - {killed}, 120)
    return {"killed": killed, "another_after_s": back, "replacement": sorted(fork_servers(server.pid) - {killed})}


def _kill_controller(d: Drill, server: RunningServer, check_only: bool = False) -> dict[str, Any]:
    parent = int(d.controller_pid_file.read_text())
    killed = _one([p for p in children_of(parent) if command_name(p) == "packrat.cli"],
                  f"controllers under pid {parent} (make run starts it with --restart-on-crash)")
    if check_only:
        return {}
    os.kill(killed, signal.SIGKILL)
    status = f"{d.controller_url}/v1/models/{d.model}/status"

    def answers() -> bool:
        try:
            with session_for(status) as s:
                return s.get(status, headers=server.management_headers(), timeout=5).status_code == 200
        except Exception:  # noqa: BLE001 - not up yet
            return False

    time.sleep(0.5)  # the killed one's port is closed by now
    return {"killed": killed, "answering_after_s": _seconds_until(answers, 300),
            "supervisor": parent, "supervisor_alive": os.path.exists(f"/proc/{parent}")}


def jvms(server: RunningServer) -> set[int]:
    """TorchServe's frontend: the JVMs in the server's process group (one while it runs)."""
    return {pid for pid in group_members(server.pid) if comm(pid) == "java"}


def _kill_frontend(d: Drill, server: RunningServer) -> dict[str, Any]:
    """SIGKILL to the JVM; when another ran, and when the controller's restart watch had made the
    model's last plan live again (its swap's set_default, from the controller's swap records)."""
    killed = _one(jvms(server), f"JVMs in TorchServe's process group {server.pid}")
    killed_at = time.time()
    os.kill(killed, signal.SIGKILL)
    another = _seconds_until(lambda: jvms(server) - {killed}, 300)
    url = f"{d.controller_url}/v1/models/{d.model}/status"
    live_phases = ("create", "register", "ready", "set_default")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with session_for(url) as s:  # the management key is read again: a new JVM made new ones
                swaps = s.get(url, headers=server.management_headers(), timeout=10).json().get("last_swaps") or []
        except Exception:  # noqa: BLE001 - the controller's answer waits for TorchServe
            swaps = []
        for rec in swaps:
            if rec.get("started_at", 0) >= killed_at and rec.get("outcome") == "applied":
                live_at = rec["started_at"] + sum(v for k, v in (rec.get("phases_s") or {}).items() if k in live_phases)
                return {"killed": killed, "another_after_s": another, "version_after": rec.get("to_version"),
                        "last_plan_again_after_s": round(live_at - killed_at, 2)}
        time.sleep(0.5)
    return {"killed": killed, "another_after_s": another, "version_after": None, "last_plan_again_after_s": None}


def _swap(d: Drill, server: RunningServer, fork_server: list[int]) -> dict[str, Any]:
    url = f"{d.controller_url}/v1/models/{d.swap_model}/apply"
    body = {"instances": list(d.swap_plan), "pin": False}
    started = time.monotonic()
    with session_for(url) as s:
        while True:  # 409: a tune or another swap of it runs; wait for it
            r = s.post(url, json=body, headers=server.management_headers(), timeout=600)
            if r.status_code != 409 or time.monotonic() - started > 600:
                break
            time.sleep(2)
    if r.status_code != 200:
        return {"status": r.status_code, "error": r.text[:300]}
    swap = r.json()["swap"]
    client = ManagementClient(server.management_url, server.key_file)
    workers = [w["pid"] for w in client.describe(d.swap_model).get("workers", [])]
    return {"status": 200, "version": swap.get("to_version"), "duration_s": swap.get("duration_s"),
            "outcome": swap.get("outcome"),
            "workers": workers, "forked_by_new_fork_server": bool(workers) and all(
                _parent(pid) in fork_server for pid in workers)}


def _ready_workers(client: ManagementClient, model: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """The default version and its worker pids, once every worker is READY (one still
    starting has pid -1)."""
    deadline = time.monotonic() + timeout_s
    while True:
        described = client.describe(model)
        workers = described.get("workers", [])
        if (workers and all(w.get("status") == "READY" and int(w.get("pid", -1)) > 0 for w in workers)) \
                or time.monotonic() > deadline:
            return {"version": described.get("modelVersion"), "pids": sorted(int(w.get("pid", -1)) for w in workers)}
        time.sleep(0.2)


def run_drill(d: Drill) -> dict[str, Any]:
    """The drill; its record (outcomes, what came back and when)."""
    server = RunningServer.attach(d.workdir)
    _kill_fork_server(server, check_only=True)  # both there, before any load: a clear error
    _kill_controller(d, server, check_only=True)
    if d.frontend_kill_at is not None:
        _one(jvms(server), f"JVMs in TorchServe's process group {server.pid}")
    client = ManagementClient(server.management_url, server.key_file)
    before = _ready_workers(client, d.model)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = _Outcomes()
    until = out.started + d.seconds
    threads = [threading.Thread(target=_client, args=(d, server, out, until), daemon=True)
               for _ in range(d.clients)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, out.started + d.forkserver_kill_at - time.monotonic()))
    fork = _kill_fork_server(server)
    time.sleep(max(0.0, out.started + d.controller_kill_at - time.monotonic()))
    ctl = _kill_controller(d, server)
    frontend = None
    if d.frontend_kill_at is not None:
        time.sleep(max(0.0, out.started + d.frontend_kill_at - time.monotonic()))
        frontend = _kill_frontend(d, server)
    for t in threads:
        t.join(d.seconds + 180)
    after = _ready_workers(client, d.model)
    return {"started": started, "machine": describe_machine().label,
            "cores": len(os.sched_getaffinity(0)), "model": d.model, "clients": d.clients, "seconds": d.seconds,
            "fork_server": fork, "controller": ctl, "frontend": frontend, "workers_before": before,
            "workers_after": after, "swap": _swap(d, server, fork["replacement"]), "rows": out.rows}


def summary(rows: list[tuple[float, str, float]], first_kill_s: float) -> dict[str, Any]:
    """Counts by outcome, and the answered requests' latency before the first kill and from it on."""
    counts: dict[str, int] = {}
    for _t, outcome, _ms in rows:
        counts[outcome] = counts.get(outcome, 0) + 1

    def lat(values: list[float]) -> str:
        return f"p50 {statistics.median(values):.1f} ms, max {max(values):.1f} ms" if values else "none"

    return {"requests": len(rows), "by_outcome": counts, "failed": len(rows) - counts.get("200", 0),
            "before": lat([ms for t, o, ms in rows if o == "200" and t < first_kill_s]),
            "after": lat([ms for t, o, ms in rows if o == "200" and t >= first_kill_s])}


def windows(rows: list[tuple[float, str, float]], seconds: float, width_s: float = 5.0) -> list[str]:
    """One table row per `width_s` of send time."""
    out = []
    start = 0.0
    while start < seconds:
        inside = [(o, ms) for t, o, ms in rows if start <= t < start + width_s]
        lat = [ms for _o, ms in inside]
        out.append(f"| {start:g}-{start + width_s:g} s | {len(inside)} | {sum(o != '200' for o, _ in inside)} | "
                   f"{statistics.median(lat):.1f} | {max(lat):.1f} |" if lat else f"| {start:g}-{start + width_s:g} s | 0 | 0 | | |")
        start += width_s
    return out


def frontend_figures(rec: dict[str, Any], kill_at: float) -> dict[str, Any]:
    """What the frontend's kill cost, against what the earlier faults did: the requests that
    failed before it (the fork server's and the controller's kills), those in flight at it and
    those sent after it that failed, and how long after it the first request sent was answered."""
    rows = rec["rows"]
    failed = [(t, t + ms / 1000) for t, o, ms in rows if o != "200"]
    answered = [t for t, o, _ms in rows if o == "200" and t >= kill_at]
    return {"sent_before": sum(t < kill_at for t, _o, _ms in rows),
            "failed_earlier": sum(end < kill_at for _t, end in failed),
            "in_flight": sum(t < kill_at <= end for t, end in failed),
            "failed_after": sum(t >= kill_at for t, _end in failed),
            "served_again_after_s": round(min(answered) - kill_at, 2) if answered else None}


def _frontend_lines(rec: dict[str, Any], d: Drill) -> tuple[str, list[str]]:
    """The figures line's words and the table's rows for the frontend's kill ("", [] without one)."""
    fe = rec.get("frontend")
    if not fe or d.frontend_kill_at is None:
        return "", []
    f = frontend_figures(rec, d.frontend_kill_at)
    words = (f"; then the frontend (JVM) killed -9 at {d.frontend_kill_at:g} s: {f['failed_earlier']} of the "
             f"{f['sent_before']} requests sent before it had failed, {f['in_flight']} in flight at it failed and "
             f"{f['failed_after']} sent after it (refused while it was down); another JVM after "
             f"{fe['another_after_s']} s, the first answered request was sent {f['served_again_after_s']} s after the "
             f"kill, the model's last plan live again after {fe['last_plan_again_after_s']} s")
    return words, [
        f"| the frontend (JVM, pid {fe['killed']}) killed at {d.frontend_kill_at:g} s | another JVM after "
        f"{fe['another_after_s']} s; the first request answered was sent {f['served_again_after_s']} s after the "
        f"kill; {f['in_flight']} requests in flight at the kill and {f['failed_after']} sent after it failed; "
        f"{f['failed_earlier']} of the {f['sent_before']} sent before it had failed |",
        f"| `{d.model}` after the frontend's restart | TorchServe loaded its base archive (--models); the "
        f"controller's swap made its last plan live again {fe['last_plan_again_after_s']} s after the kill "
        f"(version {fe['version_after']}) |"]


def write(rec: dict[str, Any], d: Drill, out_dir: Path, name: str) -> Path:
    """<out_dir>/fault-drill-<name>.md and .json (the rows)."""
    s = summary(rec["rows"], d.forkserver_kill_at)
    frontend_words, frontend_rows = _frontend_lines(rec, d)
    (out_dir / f"fault-drill-{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
    fork, ctl, swap = rec["fork_server"], rec["controller"], rec["swap"]
    before, after = rec["workers_before"], rec["workers_after"]
    if rec.get("frontend"):
        workers = (f"version {before['version']} -> {after['version']}, other processes: the new frontend's, "
                   "the last plan applied again")
    elif before == after:
        workers = "the same processes"
    elif before["version"] != after["version"]:
        workers = f"version {before['version']} -> {after['version']}: a swap (the re-plan loop follows the load)"
    else:
        workers = "the same version, other processes: restarted"
    md = "\n".join([
        "---", f"date: {rec['started']}", f"machine: {rec['machine']}, {rec['cores']} cores", f"command: {d.command}",
        ("figures: " + (f"the fork server and the controller killed -9 under {d.clients} clients on {d.model}"
                        if frontend_words else
                        f"{s['failed']} of {s['requests']} requests failed while the fork server and the controller "
                        f"were killed -9 under {d.clients} clients on {d.model}"))
        + f"; another fork server after {fork['another_after_s']} s, "
        f"the controller answering again after {ctl['answering_after_s']} s; the next swap's workers forked by the "
        f"new fork server: {swap.get('forked_by_new_fork_server')}{frontend_words}",
        "---", "",
        f"# Fault drill: {name}", "",
        f"{d.clients} closed-loop clients sent the same payload to `{d.model}` for {d.seconds:g} s; at "
        f"{d.forkserver_kill_at:g} s the fork server (pid {fork['killed']}) was killed with SIGKILL, at "
        f"{d.controller_kill_at:g} s the controller (pid {ctl['killed']})"
        + (f", at {d.frontend_kill_at:g} s TorchServe's frontend" if frontend_rows else "")
        + f"; then a plan was applied to `{d.swap_model}`.", "",
        "| what | result |", "|---|---|",
        f"| requests | {s['requests']}: {', '.join(f'{k} x{v}' for k, v in sorted(s['by_outcome'].items()))} |",
        f"| latency of the answered, before the first kill | {s['before']} |",
        f"| latency of the answered, from the first kill on | {s['after']} |",
        f"| `{d.model}`'s workers | before {before['pids']}, after {after['pids']}: {workers} |",
        f"| another fork server | after {fork['another_after_s']} s (pid {fork['replacement']}) |",
        f"| the controller answering again | after {ctl['answering_after_s']} s; its supervisor alive: "
        f"{ctl['supervisor_alive']} |",
        f"| the swap of `{d.swap_model}` afterwards | HTTP {swap.get('status')}, {swap.get('duration_s')} s, workers "
        f"{swap.get('workers')}, forked by the new fork server: {swap.get('forked_by_new_fork_server')} |",
        *frontend_rows, "",
        "Requests by when they were sent (what came back up takes its CPU from the serving workers):", "",
        "| sent at | requests | not 200 | p50 ms | max ms |", "|---|---:|---:|---:|---:|",
        *windows(rec["rows"], d.seconds), "",
    ])
    path = out_dir / f"fault-drill-{name}.md"
    path.write_text(md)
    return path
