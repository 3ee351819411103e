"""A fork server's private directory: named for its owner, and removed by the next one made
when that owner died without removing it (SIGKILL)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

from packrat.bench.proc_cpu import group_members
from packrat.forkserver.private_dir import make_private_dir, owner_pid
from serving_support import process_alive
from waiting import wait_until


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid)
    return child.pid


def test_owner_pid_reads_only_the_new_names():
    assert owner_pid("packrat-fork-123-abcd") == 123
    assert owner_pid("packrat-fork-abcd1234") is None  # made before the pid was in the name
    assert owner_pid("packrat-fork-0-x") is None
    assert owner_pid("packrat-fork-12") is None
    assert owner_pid("other-123-abcd") is None
    assert owner_pid("packrat-fork-99999999999999999999-x") is None  # beyond any pid_max


def test_a_new_directory_removes_only_this_users_directories_whose_owner_is_gone(tmp_path):
    dead = _dead_pid()
    orphan = tmp_path / f"packrat-fork-{dead}-orphan"
    orphan.mkdir()
    (orphan / "sock").write_bytes(b"")  # what a SIGKILLed server leaves
    live = tmp_path / f"packrat-fork-{os.getpid()}-live"
    live.mkdir()
    unnamed = tmp_path / "packrat-fork-oldstyle"
    unnamed.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / f"packrat-fork-{dead}-link"
    link.symlink_to(target)
    a_file = tmp_path / f"packrat-fork-{dead}-file"
    a_file.write_text("kept")
    huge = tmp_path / "packrat-fork-99999999999999999999-x"  # kill() would overflow on it
    huge.mkdir()

    made = make_private_dir(tmp_path)

    assert not orphan.exists()
    assert live.is_dir() and unnamed.is_dir() and target.is_dir()
    assert link.is_symlink() and a_file.read_text() == "kept" and huge.is_dir()
    assert made.parent == tmp_path and owner_pid(made.name) == os.getpid()
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


# Starts this process's own fork server (as a controller or the profiler does), says where
# its socket is, then waits to be killed.
_OWNER = """\
import sys, time
from packrat.forkserver import client
path = client._OWN.socket_path()
print(path, flush=True)
time.sleep(300)
"""


def test_the_directory_of_an_owner_killed_minus_9_goes_with_the_next_fork_server():
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True,
                             start_new_session=True, env={**os.environ, "PACKRAT_FORKSERVER": "1"})
    try:
        line = owner.stdout.readline().strip()
        assert line.endswith("/sock"), line
        private = Path(line).parent
        assert owner_pid(private.name) == owner.pid
        assert Path(line).exists()
    finally:
        os.killpg(owner.pid, signal.SIGKILL)  # no handler runs: nothing removes the directory
        owner.wait()
    wait_until(lambda: not group_members(owner.pid), 30, "the killed owner's fork server gone")
    assert private.is_dir()  # what SIGKILL leaves

    made = make_private_dir("/tmp")
    try:
        assert not private.exists()
    finally:
        made.rmdir()

