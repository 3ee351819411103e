"""A fork server's private directory (its socket; the launcher's shim beside it), and the
removal of those whose owner died without removing its own.

    /tmp/packrat-fork-<owner pid>-<random>/sock

The owner (the process that made the directory: `packrat.forkserver.launch`, or the
controller or profiler that started its own fork server) removes it when it stops, also on
SIGTERM. SIGKILL runs no handler: a controller or launcher killed -9 leaves its directory
behind (an empty socket). So whoever makes a new one first removes this user's
directories whose owner pid no longer runs. The pid in the name is the only thing read;
a directory without one (made before the pid was in the name), another user's, or a link
is left alone. A pid reused by another process keeps its directory (a leak, not a loss). The
limit: the pid is read in this process's pid namespace, so two containers that share one
/tmp as the same user could remove each other's live directories; give each its own
TMPDIR (the launcher makes its directory there).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

PREFIX = "packrat-fork-"
_PID_MAX = 2**22  # the kernel's limit on pid_max (PID_MAX_LIMIT on 64-bit)


def owner_pid(name: str) -> int | None:
    """The pid in `packrat-fork-<pid>-<random>`; None for any other name."""
    if not name.startswith(PREFIX):
        return None
    pid, sep, _ = name[len(PREFIX):].partition("-")
    # Bounded: a pid the kernel cannot have (a name made by hand) is no owner, not an error.
    return int(pid) if sep and pid.isdigit() and 0 < int(pid) <= _PID_MAX else None


def _running(pid: int) -> bool:
    """Whether a process with this pid runs (another user's too: kill() then raises
    PermissionError, which says it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_orphans(base: str | Path) -> list[Path]:
    """Remove this user's packrat-fork-<pid>-* directories under `base` whose pid is gone;
    returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        pid = owner_pid(entry.name)
        if pid is None or _running(pid):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(Path(entry.path))
    return removed


def make_private_dir(base: str | Path | None = None) -> Path:
    """A new 0700 directory under `base` (the system's temporary directory by default) named
    for this process, after removing the orphans there."""
    where = Path(base) if base is not None else Path(tempfile.gettempdir())
    remove_orphans(where)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=where))
