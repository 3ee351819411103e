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
unchanged. A fork server that ends while TorchServe runs (killed, OOM) is started
again (KeptForkServer); its workers serve on meanwhile, and workers started in between
start cold. A frontend (the JVM) that crashes is started again too, with the same
arguments (keep_frontend): the models named by `--models` load again, and a controller
beside it applies each one's last plan again (its restart watch). What was registered
later is gone with the JVM, as with `torchserve --ncs`; requests in flight at the crash
fail, as they would with `torchserve`. Stopped on purpose (`torchserve --stop`, SIGTERM
to the JVM or to this process's group) it ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from packrat import settings
from packrat.backoff import STOPPED_EXITS, Backoff, crashed, how_it_ended
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
            server = KeptForkServer([real_python, "-m", "packrat.forkserver.server",
                                     "--socket", str(socket_path), "--parent", str(os.getpid()),
                                     "--preload", ",".join(BASE_PRELOAD),
                                     "--idle-preload", ",".join(MODEL_PRELOAD)], socket_path)
            sys.executable = str(shim)
            print(f"packrat: {favour_frontend(settings.value('frontend_nice'))}", file=sys.stderr, flush=True)
        keep_frontend(args)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(private, ignore_errors=True)


class KeptForkServer:
    """The fork server as this process's child, started again whenever it ends before stop().

    Its workers outlive it (the shim follows them), so a killed fork server costs no request;
    without another one every later worker start (a swap, a restart) would be cold.
    """

    def __init__(self, command: list[str], socket_path: Path) -> None:
        self._command = command
        self._socket_path = socket_path
        self._lock = threading.Lock()  # stop() against a restart
        self._stopping = False
        self.proc = subprocess.Popen(command)
        threading.Thread(target=self._keep, name="packrat-fork-server-keeper", daemon=True).start()

    def _keep(self) -> None:
        backoff = Backoff()  # 1 s, doubling to 60 s while each one lives under a minute
        while True:
            proc, started = self.proc, time.monotonic()
            status = proc.wait()
            delay = backoff.after(time.monotonic() - started)
            with self._lock:
                if self._stopping:
                    return
            print(f"packrat: the fork server (pid {proc.pid}) ended with status {status}; its workers "
                  f"serve on, and another starts in {delay:.0f} s (workers starting meanwhile start cold)",
                  file=sys.stderr, flush=True)
            time.sleep(delay)
            with self._lock:
                if self._stopping:
                    return
                self._socket_path.unlink(missing_ok=True)  # the dead one's: the new one binds it
                self.proc = subprocess.Popen(self._command)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


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


# A JVM that ran this long and then exited non-zero crashed; sooner, it refused to start
# (a port taken, a bad config), which starting again would only repeat.
FRONTEND_MIN_UPTIME_S = 10.0


def keep_frontend(args: list[str], backoff: Backoff | None = None) -> None:
    """TorchServe's launcher in the foreground, started again each time its JVM crashes (killed
    by a signal other than a stop signal, SIGKILL of an OOM kill included, or a non-zero exit
    other than 143 after FRONTEND_MIN_UPTIME_S); returns once it ends otherwise."""
    backoff = backoff or Backoff()
    while True:
        started = time.monotonic()
        jvm = _run_torchserve(args)
        lived = time.monotonic() - started
        # start() waited for the JVM in the foreground: its returncode is set.
        if jvm is None or not crashed(jvm.returncode, lived, FRONTEND_MIN_UPTIME_S, STOPPED_EXITS):
            return
        delay = backoff.after(lived)
        models = "the models in --models load again; " if "--models" in args else ""
        print(f"packrat: TorchServe's frontend (pid {jvm.pid}) {how_it_ended(jvm.returncode)} after {lived:.0f} s; "
              f"starting it again in {delay:g} s with the same arguments ({models}with token authorization on, "
              "it writes new keys into key_file.json)", file=sys.stderr, flush=True)
        time.sleep(delay)


def _run_torchserve(args: list[str]) -> subprocess.Popen | None:
    """TorchServe's own launcher (ts.model_server.start) with `args`; the JVM it started and
    waited for in the foreground (None: it started none, e.g. --stop or already running).

    start() keeps the JVM's exit status to itself: its module's `subprocess` is swapped for one
    whose Popen remembers what it started (only there: other threads' Popen are untouched)."""
    import types

    import ts.model_server as ts_launcher

    started: list[subprocess.Popen] = []

    class _Remembered(subprocess.Popen):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, **kw)  # type: ignore[arg-type]
            started.append(self)

    ts_launcher.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": _Remembered})
    sys.argv = ["torchserve", *args]
    try:
        ts_launcher.start()
    finally:
        ts_launcher.subprocess = subprocess
    return started[-1] if started else None


if __name__ == "__main__":
    main()
