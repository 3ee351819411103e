"""scripts/drill_faults.py's measurement (packrat.bench.fault_drill) against a small make-run
layout: a real TorchServe, a controller under --restart-on-crash, both faults, the swap."""

from __future__ import annotations

import json

import pytest

from packrat.bench.fault_drill import Drill, run_drill, summary, write
from serving_support import noop_with_controller


def test_summary_counts_every_outcome_and_splits_latency_at_the_first_kill() -> None:
    rows = [(0.5, "200", 10.0), (1.0, "200", 30.0), (2.5, "503", 5.0), (3.0, "ConnectionError", 1.0),
            (4.0, "200", 50.0)]
    s = summary(rows, first_kill_s=2.0)
    assert s["requests"] == 5 and s["failed"] == 2
    assert s["by_outcome"] == {"200": 3, "503": 1, "ConnectionError": 1}
    assert s["before"] == "p50 20.0 ms, max 30.0 ms" and s["after"] == "p50 50.0 ms, max 50.0 ms"


@pytest.mark.torchserve
def test_a_controller_without_its_supervisor_is_a_clear_error_before_any_load(tiny_store, tmp_path) -> None:
    with noop_with_controller(tiny_store, tmp_path, "noop", ["--no-tune", "--no-adapt"]) as (server, ctl):
        (tmp_path / "controller.pid").write_text(str(ctl.proc.pid))
        drill = Drill(workdir=server.workdir, controller_pid_file=tmp_path / "controller.pid",
                      controller_url=ctl.url, model="noop", payload=b"ping", content_type="application/octet-stream")
        with pytest.raises(RuntimeError, match="found 0 controllers under pid .* --restart-on-crash"):
            run_drill(drill)
        assert ctl.proc.poll() is None  # nothing was killed


@pytest.mark.torchserve
def test_the_drill_loses_nothing_and_sees_both_parts_come_back(tiny_store, tmp_path) -> None:
    # The re-plan loop on, as in make run: it divides the cores among the models by their load.
    with noop_with_controller(tiny_store, tmp_path, "noop", ["--no-tune", "--restart-on-crash"]) \
            as (server, ctl):
        (tmp_path / "controller.pid").write_text(str(ctl.proc.pid))
        # A second, idle model to swap afterwards: while noop has the load, the division gives it
        # one core, where its explicit one-thread plan fits.
        (tmp_path / "store" / "idle").symlink_to(tiny_store / "noop", target_is_directory=True)
        server.register("idle")
        drill = Drill(workdir=server.workdir, controller_pid_file=tmp_path / "controller.pid",
                      controller_url=ctl.url, model="noop", payload=b"ping", content_type="application/octet-stream",
                      swap_model="idle",
                      clients=2, seconds=8.0, forkserver_kill_at=2.0, controller_kill_at=4.0, command="test")
        rec = run_drill(drill)
        md = write(rec, drill, tmp_path, "test").read_text()
    s = summary(rec["rows"], drill.forkserver_kill_at)
    assert s["requests"] > 20 and s["failed"] == 0, s
    before, after = rec["workers_before"], rec["workers_after"]
    assert before == after or before["version"] != after["version"], (before, after)  # none restarted
    assert rec["fork_server"]["another_after_s"] is not None and rec["fork_server"]["replacement"]
    assert rec["controller"]["answering_after_s"] is not None and rec["controller"]["supervisor_alive"]
    assert rec["swap"]["status"] == 200 and rec["swap"]["forked_by_new_fork_server"] is True, rec["swap"]
    assert md.startswith("---\ndate: ") and f"0 of {s['requests']} requests failed" in md
    assert json.loads((tmp_path / "fault-drill-test.json").read_text())["rows"]
