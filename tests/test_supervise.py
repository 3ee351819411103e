"""`packrat controller --restart-on-crash` (packrat/control/supervise.py): a crashed
controller is started again, a refused start or a stop is final. With a real TorchServe and
controller: tests/test_fault_drill.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from packrat.backoff import STOPPED_EXITS, Backoff, crashed, how_it_ended
from packrat.control.supervise import RestartPolicy, supervise
from serving_support import process_alive
from waiting import wait_until

QUICK = RestartPolicy(min_uptime_s=0.3, delay_s=0.05, max_delay_s=0.2, stable_s=30.0)


def _child(tmp_path: Path, body: str) -> list[str]:
    """A child that counts its runs in tmp_path/runs, then does `body` (run = this run's number)."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""\
        import os, signal, sys, time
        runs = {str(tmp_path / "runs")!r}
        run = (int(open(runs).read()) if os.path.exists(runs) else 0) + 1
        open(runs, "w").write(str(run))
        open(runs + ".pid", "w").write(str(os.getpid()))
        """) + textwrap.dedent(body))
    return [sys.executable, str(script)]


def _runs(tmp_path: Path) -> int:
    return int((tmp_path / "runs").read_text())


def test_the_backoff_doubles_to_its_cap_and_starts_over_after_a_stable_run() -> None:
    backoff = Backoff(first_s=1.0, max_s=8.0, stable_s=60.0)
    assert [backoff.after(2.0) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff.after(60.0) == 1.0 and backoff.after(0.5) == 2.0


def test_what_counts_as_a_crash_for_the_controller_and_for_the_jvm() -> None:
    kill, term = -signal.SIGKILL, -signal.SIGTERM
    assert crashed(kill, 0.1, 10.0) and crashed(-signal.SIGSEGV, 0.1, 10.0)  # whenever it happens
    assert not crashed(term, 100.0, 10.0) and not crashed(0, 100.0, 10.0)
    assert crashed(3, 10.0, 10.0) and not crashed(3, 9.9, 10.0)  # sooner: a start-up refusal
    # A JVM catches SIGTERM (torchserve --stop) and exits 143: stopped on purpose, not a crash.
    assert crashed(143, 100.0, 10.0) and not crashed(143, 100.0, 10.0, STOPPED_EXITS)
    assert crashed(1, 100.0, 10.0, STOPPED_EXITS) and crashed(kill, 100.0, 10.0, STOPPED_EXITS)
    assert (how_it_ended(kill), how_it_ended(3)) == ("was killed by SIGKILL", "exited with 3")


def test_a_child_killed_by_a_signal_is_started_again_with_a_growing_delay(tmp_path) -> None:
    said: list[str] = []
    command = _child(tmp_path, "if run < 4: os.kill(os.getpid(), signal.SIGKILL)\n")
    assert supervise(command, QUICK, said.append) == 0
    assert _runs(tmp_path) == 4
    assert len(said) == 3 and all("was killed by SIGKILL" in s for s in said), said
    assert [s.rsplit("in ", 1)[1] for s in said] == ["0.05 s", "0.1 s", "0.2 s"]  # doubled, capped


def test_a_non_zero_exit_is_a_crash_only_after_the_child_ran_a_while(tmp_path) -> None:
    said: list[str] = []
    # A start-up refusal (a port taken, a second controller): exit 1 at once, not restarted.
    (tmp_path / "refused").mkdir()
    assert supervise(_child(tmp_path / "refused", "sys.exit(1)\n"), QUICK, said.append) == 1
    assert _runs(tmp_path / "refused") == 1 and said == []
    # Exit 3 after running longer than min_uptime_s: restarted; then a clean exit ends it.
    (tmp_path / "late").mkdir()
    assert supervise(_child(tmp_path / "late", "if run == 1: time.sleep(0.5); sys.exit(3)\n"), QUICK,
                     said.append) == 0
    assert _runs(tmp_path / "late") == 2
    assert len(said) == 1 and "exited with 3" in said[0]


def _supervisor(tmp_path: Path, body: str) -> subprocess.Popen:
    command = _child(tmp_path, body)
    code = (f"import sys; from packrat.control.supervise import RestartPolicy, supervise; "
            f"sys.exit(supervise({command!r}, RestartPolicy(min_uptime_s=0.3, delay_s=0.05)))")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    wait_until(lambda: (tmp_path / "runs.pid").exists(), 60, "the supervised child")
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_is_passed_on_and_ends_both(tmp_path, sig) -> None:
    proc = _supervisor(tmp_path, "time.sleep(120)\n")
    child = int((tmp_path / "runs.pid").read_text())
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 128 + sig
    assert not process_alive(child)
    assert _runs(tmp_path) == 1 and "starting it again" not in proc.stderr.read()


def test_a_signal_ignored_at_start_stays_ignored_in_both(tmp_path) -> None:
    # make run starts it under nohup: closing the terminal (SIGHUP) must not stop the controller.
    command = _child(tmp_path, "time.sleep(120)\n")
    code = (f"import sys; from packrat.control.supervise import supervise; sys.exit(supervise({command!r}))")
    proc = subprocess.Popen(["nohup", sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        wait_until(lambda: (tmp_path / "runs.pid").exists(), 60, "the supervised child")
        child = int((tmp_path / "runs.pid").read_text())
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None and process_alive(child)
        proc.terminate()
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert not process_alive(child)
    finally:
        proc.kill()


def test_a_supervisor_killed_outright_takes_its_child_with_it(tmp_path) -> None:
    proc = _supervisor(tmp_path, "time.sleep(120)\n")
    child = int((tmp_path / "runs.pid").read_text())
    proc.kill()
    proc.wait(timeout=30)
    wait_until(lambda: not process_alive(child), 30, "the child to die with its supervisor (PDEATHSIG)")
