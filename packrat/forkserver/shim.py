# TorchServe's `python` for workers: hand this start to the fork server, or exec Python.
#
# Copied whole into the executable file packrat.forkserver.write_shim() writes, after a
# `#!<python> -SE` line, so it may use the standard library only (no site, no packrat).
# Protocol (packrat/forkserver/server.py): one connection per worker start; the shim
# sends a 4-byte length with its stdin/stdout/stderr attached (SCM_RIGHTS), then that
# many bytes of JSON {argv, cwd, env, outlive_server}; the server answers JSON lines:
# {"pid": n} or {"exec": reason}, later {"exit": code} or {"signal": n}. The shim sends
# {"signal": n} lines for signals it receives. Closing the connection asks the server to
# kill the child.
#
# The worker outlives the fork server (outlive_server: no PDEATHSIG) where this kernel
# has pidfds: a killed fork server then takes no worker down (TorchServe would restart
# every worker of every model at once, cold). Without the server the shim follows the
# child through a pidfd: signals go to it directly, and its end is the shim's end (the
# status is then unknown to the shim: it dies by the signal it passed on, else exits 1).

import json
import os
import select
import signal
import socket
import struct
import sys


def _exec_python(real_python: str, argv: list, worker_nice=None) -> None:
    # Started by the frontend, this process has the frontend's nice; a worker runs at the
    # workers' (raising a nice needs no privilege).
    if worker_nice is not None and os.getpriority(os.PRIO_PROCESS, 0) < worker_nice:
        os.setpriority(os.PRIO_PROCESS, 0, worker_nice)
    os.execv(real_python, [real_python, *argv])


def _pidfds_work() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
        return hasattr(signal, "pidfd_send_signal")
    except (AttributeError, OSError):  # Python < 3.9, Linux < 5.3
        return False


def _die(signum) -> None:
    # Die the way the child died, so TorchServe reads the same status.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def main(real_python: str, socket_path: str, worker_nice=None) -> None:
    argv = sys.argv[1:]
    outlive = _pidfds_work()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
        body = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ),
                           "outlive_server": outlive}).encode()
        socket.send_fds(sock, [struct.pack("!I", len(body))], [0, 1, 2])
        sock.sendall(body)
        replies = sock.makefile("rb", buffering=0)
        first = json.loads(replies.readline() or b"{}")
    except (OSError, ValueError):
        first = {}
    if "pid" not in first:  # no fork server, or it declined: what TorchServe would do itself
        sock.close()
        _exec_python(real_python, argv, worker_nice)
    pidfd = None
    if outlive:
        try:
            pidfd = os.pidfd_open(int(first["pid"]))
        except OSError:  # it ended already: the server's next line says how
            pass
    _follow(sock, pidfd)


def _follow(sock, pidfd) -> None:
    """Relay signals to the child and exit as it does, through the server while it is there."""
    state = {"server": True, "passed": None}

    def forward(signum, _frame):
        state["passed"] = signum
        if state["server"]:
            try:
                sock.sendall(json.dumps({"signal": signum}).encode() + b"\n")
                return
            except OSError:
                state["server"] = False
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signum)
            except OSError:
                pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, forward)
    pending = b""
    while True:
        if state["server"]:
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            if not data:  # the fork server is gone; its child is not, where a pidfd follows it
                state["server"] = False
                continue
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                reply = json.loads(line)
                if "signal" in reply:
                    _die(reply["signal"])
                if "exit" in reply:
                    os._exit(reply["exit"])
        else:  # the server gone: seen here, or by forward() when a signal could not reach it
            if pidfd is None:  # no pidfd (a kernel before 5.3, or the child had ended): nothing to follow
                os._exit(1)
            select.select([pidfd], [], [])  # readable once the child has ended
            if state["passed"] is not None:
                _die(state["passed"])
            os._exit(1)
