"""Directories others (or a killed process) leave behind do not stop Packrat.

- A version create killed mid-write leaves `.<model>.pN.tmp-*` in the model store
  (packrat/apply/versions.py); the next create removes those older than an hour
  and leaves younger ones (a create still running) and other models' alone.
- The default slot directory is per user (`$TMPDIR/packrat-slots-<uid>`): a worker
  starts although another user squatted the old shared name, `$TMPDIR/packrat-slots`.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from packrat.apply import versions
from packrat.types import Instance, Plan
from test_apply_versions import store  # noqa: F401 - the model store fixture

HOUR = versions.STALE_TMP_S

PLAN = Plan(cores=1, batch=1, instances=(Instance(1, 1, 3.0),), predicted_latency_ms=3.0)

# A create killed (SIGKILL, no cleanup runs) after its first link: what a controller
# killed mid-swap leaves.
KILLED_CREATE = """
import os, signal, sys
from packrat.apply import versions
from packrat.types import Instance, Plan
real = os.symlink
def link_then_die(*a, **k):
    real(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)
versions.os.symlink = link_then_die
plan = Plan(cores=1, batch=1, instances=(Instance(1, 1, 3.0),), predicted_latency_ms=3.0)
versions.create_version(sys.argv[1], "m", "m", plan, [0])
"""


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_a_killed_creates_temp_dir_is_removed_by_a_later_create(store: Path) -> None:
    r = subprocess.run([sys.executable, "-c", KILLED_CREATE, str(store)], capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    (left,) = store.glob(".m.p*.tmp-*")  # the killed create's half directory
    assert any(left.iterdir())
    _age(left, HOUR + 60)
    young = store / ".m.p7.tmp-aaaaaa"  # a create that may still be running
    young.mkdir()
    _age(young, HOUR - 300)
    other = store / ".other.p1.tmp-bbbbbb"  # another model's
    other.mkdir()
    _age(other, HOUR + 60)

    vdir = versions.create_version(store, "m", "m", PLAN, [0])
    assert vdir.path.is_dir() and not left.exists()
    assert young.exists() and other.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory another user's needs root")
def test_a_worker_starts_although_another_user_squatted_the_shared_slot_dir_name(tmp_path: Path) -> None:
    squatted = tmp_path / "packrat-slots"
    squatted.mkdir()
    os.chmod(squatted, 0o777)
    os.chown(squatted, 65534, 65534)  # nobody's, writable by all: the old default refused it
    env = {k: v for k, v in os.environ.items() if k != "PACKRAT_SLOT_DIR"}
    env["TMPDIR"] = str(tmp_path)
    claim = ("import json; from packrat import slots;"
             "c = slots.claim_and_pin({'packrat': {'plan_id': 'p-squat', 'slots': [{'cores': [%d], 'threads': 1}]}});"
             "print(json.dumps({'dir': str(slots.slot_root()), 'lock': c.lock_path}))" % min(os.sched_getaffinity(0)))
    r = subprocess.run([sys.executable, "-c", claim], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    mine = tmp_path / f"packrat-slots-{os.getuid()}"
    assert out["dir"] == str(mine) and out["lock"].startswith(str(mine) + "/")
    st = os.lstat(mine)
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert list(squatted.iterdir()) == []  # nothing written into the squatted one
