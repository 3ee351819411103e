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
from pathlib import Path

from packrat import settings
from packrat.forkserver import enabled, write_shim
from packrat.forkserver.private_dir import make_private_dir
from packrat.forkserver.server import BASE_PRELOAD, MODEL_PRELOAD
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
    private = make_private_dir()
    if len(str(private / "sock")) > _SOCKET_PATH_MAX:
        private.rmdir()
        private = make_private_dir("/tmp")
    socket_path = private / "sock"
    shim = private / "python"
    server = None
    # Stopping a server signals its whole group: leave through `finally`, not past it.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        workers_nice = os.getpriority(os.PRIO_PROCESS, 0)
        if write_shim(shim, real_python, str(socket_path), worker_nice=workers_nice):
            # Started before the frontend is favoured: the workers it forks keep this nice.
            # What every worker imports before the first fork, what only some need while idle.
            server = subprocess.Popen([real_python, "-m", "packrat.forkserver.server",
                                       "--socket", str(socket_path), "--parent", str(os.getpid()),
                                       "--preload", ",".join(BASE_PRELOAD),
                                       "--idle-preload", ",".join(MODEL_PRELOAD)])
            sys.executable = str(shim)
            print(f"packrat: {favour_frontend(settings.value('frontend_nice'))}", file=sys.stderr, flush=True)
        _run_torchserve(args)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(private, ignore_errors=True)


def favour_frontend(levels: int) -> str:
    """Lower this thread's nice by `levels` (0..20) before it starts TorchServe's JVM, whose
    threads inherit it; what was done, in words.

    Why: each worker waits on the frontend between batches (measured with perf trace:
    docs/benchmarks/efficiency-avx2-epyc.md), and on cores the workers keep busy the frontend's
    threads that take a batch's answer, write the HTTP responses and hand the next batch over
    may wait for a worker's time slice when they wake. They use little CPU, so favouring them
    takes little from the workers (served 1.055x and 1.000x side by side:
    code-ab-frontend-nice-minilm8.md, code-ab-frontend-nice-bert8.md). Lowering a nice needs root or
    CAP_SYS_NICE (or RLIMIT_NICE).
    """
    if not 0 <= levels <= 20:
        raise ValueError(f"frontend_nice must be between 0 and 20, got {levels}")
    now = os.getpriority(os.PRIO_PROCESS, 0)
    if levels == 0:
        return f"TorchServe's frontend at nice {now}, as its workers (PACKRAT_FRONTEND_NICE=0)"
    target = max(-20, now - levels)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, target)
    except PermissionError:
        return (f"TorchServe's frontend left at nice {now}, as its workers: favouring it needs root "
                "or CAP_SYS_NICE")
    return f"TorchServe's frontend at nice {target}, its workers at {now}"


def _run_torchserve(args: list[str]) -> None:
    from ts.model_server import start

    sys.argv = ["torchserve", *args]
    start()


if __name__ == "__main__":
    main()
