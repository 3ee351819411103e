# TorchServe's `python` for workers: hand this start to the fork server, or exec Python.
#
# Copied whole into the executable file packrat.forkserver.write_shim() writes, after a
# `#!<python> -SE` line, so it may use the standard library only (no site, no packrat).
# Protocol (packrat/forkserver/server.py): one connection per worker start; the shim
# sends a 4-byte length with its stdin/stdout/stderr attached (SCM_RIGHTS), then that
# many bytes of JSON {argv, cwd, env}; the server answers JSON lines: {"pid": n} or
# {"exec": reason}, later {"exit": code} or {"signal": n}. The shim sends {"signal": n}
# lines for signals it receives. Closing the connection asks the server to kill the child.

import json
import os
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


def main(real_python: str, socket_path: str, worker_nice=None) -> None:
    argv = sys.argv[1:]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
        body = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        socket.send_fds(sock, [struct.pack("!I", len(body))], [0, 1, 2])
        sock.sendall(body)
        replies = sock.makefile("rb")
        first = json.loads(replies.readline() or b"{}")
    except (OSError, ValueError):
        first = {}
    if "pid" not in first:  # no fork server, or it declined: what TorchServe would do itself
        sock.close()
        _exec_python(real_python, argv, worker_nice)

    def forward(signum, _frame):
        try:
            sock.sendall(json.dumps({"signal": signum}).encode() + b"\n")
        except OSError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, forward)
    while True:
        try:
            line = replies.readline()
        except InterruptedError:
            continue
        if not line:  # the fork server is gone, and with it the child (PDEATHSIG)
            os._exit(1)
        reply = json.loads(line)
        if "signal" in reply:  # die the way the child died, so TorchServe reads the same status
            signal.signal(reply["signal"], signal.SIG_DFL)
            os.kill(os.getpid(), reply["signal"])
            os._exit(128 + reply["signal"])
        if "exit" in reply:
            os._exit(reply["exit"])
