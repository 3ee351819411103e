"""Processes forked warm for this Python process itself (the profiler's workers).

The shim (shim.py) asks TorchServe's fork server for workers; this module does the
same from inside a Packrat process, with the process's own fork server, started on
first use and gone when the process exits (the server watches its parent). A
profiling worker then starts in tenths of a second instead of the ~4 s of CPU its
imports take cold, and runs in the same kind of process a served worker does.

    proc = spawn(["-m", "packrat.profile.worker", job, "3"], env, fds={1: log, 2: log, 3: pipe},
                 preload=("numpy", "torch"))
    if proc is None: ...  # no fork server here (PACKRAT_FORKSERVER=0, or it declined): Popen
    proc.wait(); proc.kill()

The server imports nothing by itself: each request names what its child will import
(`preload`), and the server imports what it lacks of that before it forks the child, in
the time the child would have spent on it. So a profile of a model that needs no
transformers never waits for it, and nothing is imported while the workers of a profile
are timed (all its requests name the same modules: only its first imports).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from packrat.forkserver import enabled
from packrat.forkserver.private_dir import make_private_dir
from packrat.forkserver.server import PRELOAD

# A request waits while the server imports what it names (torch and transformers: ~4-7 s CPU).
_FIRST_REPLY_TIMEOUT_S = 120.0
_BIND_TIMEOUT_S = 30.0


class ForkedProcess:
    """A child of the fork server, seen through its connection (Popen's wait/kill/returncode)."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._replies = conn.makefile("rb")

    def wait(self) -> int:
        while self.returncode is None:
            line = self._replies.readline()
            if not line:  # the fork server is gone, and its children with it (PDEATHSIG)
                self.returncode = -signal.SIGKILL
                break
            reply = json.loads(line)
            if "exit" in reply:
                self.returncode = int(reply["exit"])
            elif "signal" in reply:
                self.returncode = -int(reply["signal"])
        self._conn.close()
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the child (closing the connection would do too; this also says why)."""
        if self.returncode is None:
            try:
                self._conn.sendall(json.dumps({"signal": signal.SIGKILL}).encode() + b"\n")
            except OSError:
                pass


def request(socket_path: str, argv: list[str], env: Mapping[str, str], cwd: str,
            fds: Mapping[int, int], preload: Sequence[str] = ()) -> ForkedProcess | None:
    """Ask the fork server at `socket_path` for `python <argv>`; None if it is not there or declines.

    `fds`: descriptor number in the child -> descriptor here (sent with SCM_RIGHTS; the
    caller keeps and closes its own). `preload`: modules the server imports (where it has
    not yet) before it forks this child.
    """
    targets, sent = list(fds), list(fds.values())
    message = {"argv": argv, "cwd": cwd, "env": dict(env), "fd_targets": targets}
    if preload:
        message["preload"] = list(preload)
    body = json.dumps(message).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(_FIRST_REPLY_TIMEOUT_S)
        sock.connect(socket_path)
        socket.send_fds(sock, [struct.pack("!I", len(body))], sent)
        sock.sendall(body)
        first = json.loads(sock.makefile("rb").readline() or b"{}")
    except (OSError, ValueError):
        first = {}
    if "pid" not in first:
        sock.close()
        return None
    sock.settimeout(None)
    return ForkedProcess(int(first["pid"]), sock)


class _OwnServer:
    """This process's fork server: started once, on first use; stopped at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None
        atexit.register(self.stop)  # a no-op until started

    def socket_path(self) -> str | None:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            return str(self._dir / "sock") if self._dir is not None else None

    def _start(self) -> None:
        self.stop()
        self._dir = make_private_dir("/tmp")  # short: sun_path
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        sock = self._dir / "sock"
        # No preload of its own: each request names its own (spawn's `preload`).
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "packrat.forkserver.server", "--socket", str(sock),
             "--parent", str(os.getpid()), "--preload", ""], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # its one line: "ready"
        # The server binds its socket first: wait for the bind, not for any import.
        deadline = time.monotonic() + _BIND_TIMEOUT_S
        while not sock.exists() and self._proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if not sock.exists():
            self.stop()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


_OWN = _OwnServer()


def spawn(argv: list[str], env: Mapping[str, str], fds: Mapping[int, int],
          cwd: str | None = None, preload: Sequence[str] = PRELOAD) -> ForkedProcess | None:
    """`python <argv>` forked by this process's own fork server; None when there is none
    (PACKRAT_FORKSERVER=0) or it declined (e.g. LD_PRELOAD differs): start it yourself.

    `preload`: what the child will import, imported by the server first (once: later
    children share it); by default torch, transformers and the demo models' families."""
    if not enabled(dict(env)):
        return None
    path = _OWN.socket_path()
    if path is None:
        return None
    return request(path, argv, env, cwd or os.getcwd(), fds, preload)
