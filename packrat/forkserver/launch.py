"""`torchserve` with its workers started by a fork server.

    packrat-torchserve --start --ts-config config.properties --model-store model-store ...
    python -m packrat.forkserver.launch -- --start --foreground ...   (what packrat.server runs)

Takes `torchserve`'s arguments. Without `--foreground` it returns at once as
`torchserve --start` does, leaving a background process that holds the fork server
until the frontend exits (`torchserve --stop` stops it).

Starts the fork server as a child (same process group: stopping the server's group
stops it too), writes the shim, and runs TorchServe's own launcher with the shim as
the `python` it hands the frontend for workers (`--python sys.executable` there, the
one switch TorchServe 0.12 has for it). Without a usable shim it runs TorchServe
unchanged.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from packrat.forkserver import enabled, write_shim
from packrat.tslog import with_log_config

_SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if "--start" in args:
        args = with_log_config(args)  # packrat/log4j2.xml unless the caller chose one
    if "--start" not in args or not enabled():  # --stop, --version, --help: TorchServe's own
        _run_torchserve(args)
        return
    if "--foreground" not in args:
        # The fork server and the shim live as long as this process: stay, in the background.
        if os.fork() > 0:
            return
        os.setsid()
        args.append("--foreground")
    real_python = sys.executable
    # A short private directory: a unix socket path must fit in 108 bytes, and 0700
    # keeps other users from asking for a fork.
    private = Path(tempfile.mkdtemp(prefix="packrat-fork-"))
    if len(str(private / "sock")) > _SOCKET_PATH_MAX:
        private.rmdir()
        private = Path(tempfile.mkdtemp(prefix="packrat-fork-", dir="/tmp"))
    socket_path = private / "sock"
    shim = private / "python"
    server = None
    # Stopping a server signals its whole group: leave through `finally`, not past it.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        if write_shim(shim, real_python, str(socket_path)):
            server = subprocess.Popen([real_python, "-m", "packrat.forkserver.server",
                                       "--socket", str(socket_path), "--parent", str(os.getpid())])
            sys.executable = str(shim)
        _run_torchserve(args)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(private, ignore_errors=True)


def _run_torchserve(args: list[str]) -> None:
    from ts.model_server import start

    sys.argv = ["torchserve", *args]
    start()


if __name__ == "__main__":
    main()
