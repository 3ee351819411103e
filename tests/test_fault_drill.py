"""scripts/drill_faults.py's measurement (packrat.bench.fault_drill) against a small make-run
layout: a real TorchServe, a controller under --restart-on-crash, both faults, the swap. It is
also where a killed fork server (packrat/forkserver) and a crashed controller
(packrat/control/supervise.py) are tested with the real processes."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from packrat.bench.fault_drill import Drill, fork_servers, frontend_figures, run_drill, summary, write
from packrat.bench.proc_cpu import children_of, controller_labels
from serving_support import noop_with_controller, process_alive
from waiting import wait_until


def test_summary_counts_every_outcome_and_splits_latency_at_the_first_kill() -> None:
    rows = [(0.5, "200", 10.0), (1.0, "200", 30.0), (2.5, "503", 5.0), (3.0, "ConnectionError", 1.0),
            (4.0, "200", 50.0)]
    s = summary(rows, first_kill_s=2.0)
    assert s["requests"] == 5 and s["failed"] == 2
    assert s["by_outcome"] == {"200": 3, "503": 1, "ConnectionError": 1}
    assert s["before"] == "p50 20.0 ms, max 30.0 ms" and s["after"] == "p50 50.0 ms, max 50.0 ms"


def test_the_frontends_kill_splits_failures_at_it_and_times_the_first_answer_after_it() -> None:
    # Killed at 3.0 s: the 503 ended before it, the ConnectionError sent at 2.9 s ended after it (in
    # flight), the 401 was sent after it; the first answer after it was sent at 5.5 s.
    rows = [(1.0, "200", 5.0), (2.0, "503", 5.0), (2.9, "ConnectionError", 200.0), (3.5, "401", 1.0),
            (5.5, "200", 9.0), (6.0, "200", 9.0)]
    assert frontend_figures({"rows": rows}, 3.0) == {"sent_before": 3, "failed_earlier": 1, "in_flight": 1,
                                                     "failed_after": 1, "served_again_after_s": 2.5}
    assert frontend_figures({"rows": rows[:4]}, 3.0)["served_again_after_s"] is None


@pytest.mark.torchserve
def test_the_helpers_killed_under_load_cost_nothing_and_come_back(tiny_store, tmp_path) -> None:
    """On a real TorchServe with the controller under --restart-on-crash (the re-plan loop on,
    as in make run), through the drill: the fork server and the controller killed -9 under
    load lose no request and restart no worker; both come back, the fork server at the
    workers' nice, and it forks the next swap's worker. Then the supervisor's other duties
    (a refused start is final, SIGTERM ends both) and the drill's clear error before any load
    when make run's pid names no supervised controller. One server for all: CI time."""
    with noop_with_controller(tiny_store, tmp_path, "noop", ["--no-tune", "--restart-on-crash"]) \
            as (server, ctl):
        (first,) = children_of(ctl.proc.pid)
        cmdline = Path(f"/proc/{first}/cmdline").read_bytes()
        assert b"packrat.cli" in cmdline and b"--restart-on-crash" not in cmdline
        pid_file = tmp_path / "controller.pid"
        pid_file.write_text(str(first))  # the controller itself, not its supervisor
        # A second, idle model to swap afterwards: while noop has the load, the division gives it
        # one core, where its explicit one-thread plan fits.
        (tmp_path / "store" / "idle").symlink_to(tiny_store / "noop", target_is_directory=True)
        server.register("idle")
        drill = Drill(workdir=server.workdir, controller_pid_file=pid_file, controller_url=ctl.url, model="noop",
                      payload=b"ping", content_type="application/octet-stream", swap_model="idle", clients=2,
                      seconds=8.0, forkserver_kill_at=2.0, controller_kill_at=4.0, command="test")
        with pytest.raises(RuntimeError, match="found 0 controllers under pid .* --restart-on-crash"):
            run_drill(drill)
        assert process_alive(first) and len(fork_servers(server.pid)) == 1  # nothing was killed

        pid_file.write_text(str(ctl.proc.pid))
        rec = run_drill(drill)
        md = write(rec, drill, tmp_path, "test").read_text()
        s = summary(rec["rows"], drill.forkserver_kill_at)
        assert s["requests"] > 20 and s["failed"] == 0, s
        assert any(t >= drill.controller_kill_at for t, _o, _ms in rec["rows"])
        before, after = rec["workers_before"], rec["workers_after"]
        assert before == after or before["version"] != after["version"], (before, after)  # none restarted
        fork, ctl_rec, swap = rec["fork_server"], rec["controller"], rec["swap"]
        assert fork["another_after_s"] is not None and len(fork["replacement"]) == 1
        assert ctl_rec["killed"] == first and ctl_rec["answering_after_s"] is not None and ctl_rec["supervisor_alive"]
        assert swap["status"] == 200 and swap["forked_by_new_fork_server"] is True, swap
        assert md.startswith("---\ndate: ") and f"0 of {s['requests']} requests failed" in md
        assert json.loads((tmp_path / "fault-drill-test.json").read_text())["rows"]
        assert f"the fork server (pid {fork['killed']}) ended" in \
            (server.workdir / "torchserve.out").read_text(errors="replace")
        assert f"the controller (pid {first}) was killed by SIGKILL" in ctl.log()
        # Started by a thread that predates the frontend's favour: the new fork server and what it
        # forked run at the workers' nice, not the JVM's. (The re-plan loop may retire a version
        # meanwhile: a process gone is skipped.)
        (replacement,) = fork["replacement"]
        nices = set()
        for pid in (replacement, *children_of(replacement)):
            try:
                nices.add(os.getpriority(os.PRIO_PROCESS, pid))
            except ProcessLookupError:
                pass
        assert nices == {os.getpriority(os.PRIO_PROCESS, 0)}, nices

        # Another controller on the same TorchServe is refused at start: final, not restarted.
        second = ctl.spawn(state=tmp_path / "state2")
        assert second.wait(timeout=120) == 1
        second_log = (tmp_path / "state2" / "controller.out").read_text()
        assert "starting it again" not in second_log and "error:" in second_log, second_log[-2000:]
        # The efficiency bench, given make run's pid, reads the child's CPU as the controller's.
        (now,) = children_of(ctl.proc.pid)
        assert controller_labels(ctl.proc.pid) == {ctl.proc.pid: "controller's supervisor (--restart-on-crash)",
                                                   now: "controller"}
        assert controller_labels(os.getpid()) == {os.getpid(): "controller"}
        # A stop (make stop's SIGTERM) ends the supervisor and its controller.
        ctl.proc.send_signal(signal.SIGTERM)
        assert ctl.proc.wait(timeout=60) in (0, 128 + signal.SIGTERM)
        wait_until(lambda: not process_alive(now), 30, "the controller to stop with its supervisor")
