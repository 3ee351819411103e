"""The fork server: import the heavy libraries once, fork a worker per request.

Run as `python -m packrat.forkserver.server --socket PATH --parent PID` (packrat.server
does it beside TorchServe). One process, one thread, one select loop: forking a process
with other threads could copy a lock some thread held. The socket is bound before the
imports, so a worker that starts meanwhile waits in the backlog instead of falling back
to a cold start. Requests come from shim.py; see its header for the protocol.

Three kinds of preload (each module imported once, then gc.freeze()):
- `--preload`: before the first fork (BASE_PRELOAD for TorchServe: what every worker imports);
- `--idle-preload`: one module per idle select() round, so a request waits for one
  module's import at most (MODEL_PRELOAD for TorchServe: what only some models need; a
  worker forked before it is in imports what it needs itself, as a cold one does);
- a request's own `preload` list: imported before that request is forked (the profiler's
  server, client.py: it must not import while its workers are timed, and knows what the
  archive it profiles needs).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import runpy
import select
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

# What an eager worker spends its start on (imports measured on the 2-core EPYC:
# numpy + torch ~2.4 s, transformers ~1.4 s, the model families' code ~3 s of CPU).
# Only third-party code: the handler and packrat_tasks come from each archive, and a
# copy imported here would shadow the archive's own.
# Every TorchServe worker imports these (its script imports ts.*, which imports torch and
# numpy; the noop task needs nothing more): imported before the first fork.
BASE_PRELOAD = (
    "numpy",
    "torch",
    "ts.model_loader",
    "ts.protocol.otf_message_handler",
    "ts.async_service",
)
# What only some models need (an eager model, or a graph runtime's first export): imported
# while idle, so a worker of a model that needs none of it does not wait for it.
# transformers and modeling_utils come first as their own steps: the shortest ones.
MODEL_PRELOAD = (
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.bert.modeling_bert",
    "transformers.models.distilbert.modeling_distilbert",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.resnet.modeling_resnet",
    "safetensors.torch",
    "tokenizers",
    "PIL.Image",
)
PRELOAD = BASE_PRELOAD + MODEL_PRELOAD  # all of it
# Read by the dynamic loader or the interpreter when a process starts: a request whose
# value differs from ours cannot be served by a fork (the shim then execs Python).
STARTUP_ONLY_ENV = ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONMALLOC")
_PR_SET_PDEATHSIG = 1
Children = dict[socket.socket, int]  # a shim's connection -> its child's pid
_REQUEST_TIMEOUT_S = 10.0


# Most descriptors one request may hand over (the shim sends stdin/stdout/stderr; the
# profiler adds its result pipe).
_MAX_FDS = 8
_FAILED: set[str] = set()  # modules whose import failed here


@dataclass
class WorkerRequest:
    argv: list[str]  # `script.py args...` or `-m module args...`
    cwd: str
    env: dict[str, str]
    fds: list[int]
    targets: list[int]  # the descriptor number each of `fds` becomes in the child
    preload: list[str] = field(default_factory=list)  # modules to import here before the fork
    # The child lives on if this server dies (the shim follows it through a pidfd); else
    # it dies with the server (PR_SET_PDEATHSIG: the profiler's workers, client.py).
    outlive_server: bool = False


def is_module_name(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def decline_reason(argv: list[str], env: dict[str, str]) -> str | None:
    """Why a fork cannot stand in for `python <argv>` in `env`; None if it can."""
    if argv[:1] == ["-m"]:
        if len(argv) < 2 or not is_module_name(argv[1]):
            return "-m without a module name"
    elif not argv or not argv[0].endswith(".py") or not os.path.isfile(argv[0]):
        return "not a script file"
    for var in STARTUP_ONLY_ENV:
        if env.get(var) != os.environ.get(var):
            return f"{var} differs from the fork server's"
    return None


def _read_request(conn: socket.socket) -> WorkerRequest:
    conn.settimeout(_REQUEST_TIMEOUT_S)
    header, fds, _flags, _addr = socket.recv_fds(conn, 4, _MAX_FDS)
    try:
        if len(header) != 4 or not fds:
            raise ValueError("malformed request header")
        (length,) = struct.unpack("!I", header)
        body = b""
        while len(body) < length:
            chunk = conn.recv(length - len(body))
            if not chunk:
                raise ValueError("request cut short")
            body += chunk
        data = json.loads(body)
        targets = [int(t) for t in data.get("fd_targets", [0, 1, 2])]
        if len(targets) != len(fds) or len(set(targets)) != len(targets) or min(targets) < 0:
            raise ValueError(f"{len(fds)} descriptors for fd_targets {targets}")
        preload = [str(m) for m in data.get("preload", [])]
        if not all(is_module_name(m) for m in preload):
            raise ValueError(f"preload names a non-module: {preload}")
        return WorkerRequest(list(data["argv"]), str(data["cwd"]), dict(data["env"]), fds, targets, preload,
                             outlive_server=data.get("outlive_server") is True)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The connecting process's (pid, uid)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the shim is gone; its child is killed when the connection reads EOF


def serve(socket_path: str, parent_pid: int, preload: tuple[str, ...],
          idle_preload: tuple[str, ...] = ()) -> WorkerRequest:
    """Serve until the parent exits or SIGTERM comes (then exit); return only in a forked
    child, its request.

    Returning unwinds this loop in the child, which closes the listener, the selector
    and the other connections there; the parent's stay open.
    """
    me = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    # Stopping a server signals its whole process group: leave through `finally` (socket
    # and directory removed) rather than die where the signal lands.
    signal.signal(signal.SIGTERM, lambda signum, _frame: _leave(signum, me))
    children: Children = {}
    pending = list(idle_preload)  # imported one per idle round, after the first fork is possible
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, \
            selectors.DefaultSelector() as selector:
        listener.bind(socket_path)
        try:
            os.chmod(socket_path, 0o600)
            listener.listen(64)
            _preload(preload)
            selector.register(listener, selectors.EVENT_READ)
            selector.register(wake_r, selectors.EVENT_READ)
            while os.getppid() == parent_pid:
                # Idle = nothing ready right now: then one module, and look again.
                events = selector.select(timeout=0.0 if pending else 1.0)
                for key, _ in events:
                    try:
                        request = _handle(key.fileobj, listener, wake_r, selector, children, me)
                    except Exception as exc:  # noqa: BLE001 - one bad event must not end the server
                        if os.getpid() != me:  # a child that failed before it became its worker
                            os._exit(1)
                        # Its crash would leave later worker starts cold until the launcher
                        # starts another, and take the profiler's workers with it (PDEATHSIG).
                        print(f"packrat fork server: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                        continue
                    if request is not None:  # in the child
                        signal.set_wakeup_fd(-1)
                        os.close(wake_r)
                        os.close(wake_w)
                        return request
                if not events and pending:
                    _import(pending.pop(0))
                    if not pending:
                        print(f"packrat fork server: imported {len(idle_preload)} more modules while idle",
                              file=sys.stderr, flush=True)
        finally:
            if os.getpid() == me:
                for pid in children.values():
                    _kill(pid, signal.SIGKILL)
                _remove(socket_path)
    sys.exit(0)


def _leave(signum: int, me: int) -> None:
    if os.getpid() != me:  # a child between its fork and become_worker: die as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    sys.exit(128 + signum)


def _remove(socket_path: str) -> None:
    """Unlink the socket, and its directory where that is an empty packrat-fork-* one (the
    profiler's server's own; launch.py's also holds the shim and removes it itself)."""
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    directory = os.path.dirname(os.path.abspath(socket_path))
    if os.path.basename(directory).startswith("packrat-fork-"):
        try:
            os.rmdir(directory)
        except OSError:  # not empty, or gone already
            pass


def _handle(source: object, listener: socket.socket, wake_r: int, selector: selectors.BaseSelector,
            children: Children, me: int) -> WorkerRequest | None:
    """One ready descriptor; returns a request only in a freshly forked child."""
    if source is listener:
        return _accept(listener, selector, children, me)
    if source == wake_r:
        _drain(wake_r)
        _reap(selector, children)
    elif source in children:
        _from_shim(source, selector, children)
    # else: a connection closed earlier in this same select() round (its child was reaped
    # first: a worker killed, then TorchServe killing its shim, both seen at once)
    return None


def _preload(names: tuple[str, ...] | list[str]) -> None:
    started = time.process_time()
    for name in names:
        _import(name)
    print(f"packrat fork server: ready, preloaded {len(names)} modules in "
          f"{time.process_time() - started:.1f} s CPU", file=sys.stderr, flush=True)


def _import(name: str) -> None:
    # numpy's OpenBLAS starts its pool at import; a worker sizes torch's pools itself
    # after pinning, and numpy does no BLAS work on the serving path.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if name in sys.modules or name in _FAILED:
        return
    try:
        importlib.import_module(name)
    except Exception as exc:  # a missing optional library: its workers import it themselves
        _FAILED.add(name)  # said once (a request's own preload comes again with every fork)
        print(f"packrat fork server: not preloaded {name}: {exc}", file=sys.stderr, flush=True)
    gc.freeze()  # keep the preloaded objects out of the children's collections: pages stay shared


def _accept(listener: socket.socket, selector: selectors.BaseSelector, children: Children,
            me: int) -> WorkerRequest | None:
    conn, _ = listener.accept()
    try:
        caller, uid = _peer(conn)
        if uid != os.getuid():
            raise PermissionError("another user's process")
        request = _read_request(conn)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"packrat fork server: request refused: {exc}", file=sys.stderr, flush=True)
        conn.close()
        return None
    reason = decline_reason(request.argv, request.env)
    if reason is None and request.preload:
        # Imported here, before this fork: the caller would wait for the same imports in its
        # child, and every later fork gets them free.
        for name in request.preload:
            _import(name)
    if reason is not None:
        _send(conn, {"exec": reason})
        for fd in request.fds:
            os.close(fd)
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for other in (conn, *children):  # the other workers' connections are not this one's
            other.close()
        if request.outlive_server:
            _die_with_caller(caller)
        else:
            _die_with(me)
        return request
    for fd in request.fds:
        os.close(fd)
    conn.settimeout(None)
    children[conn] = pid
    selector.register(conn, selectors.EVENT_READ)
    _send(conn, {"pid": pid})
    return None


def _die_with(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def _die_with_caller(caller: int) -> None:
    """A child that outlives this server still ends with its caller: the shim, which TorchServe
    sees as the worker and stops with SIGKILL (its connection's end tells this server to kill
    the child; without this server a thread waiting on the shim's pidfd does it)."""
    try:
        pidfd = os.pidfd_open(caller)
    except OSError:  # the caller is gone already
        os._exit(1)

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="packrat-shim-watch", daemon=True).start()


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _reap(selector: selectors.BaseSelector, children: Children) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = next((c for c, p in children.items() if p == pid), None)
        if conn is None:  # its shim went first (_from_shim killed it)
            continue
        if os.WIFSIGNALED(status):
            _send(conn, {"signal": os.WTERMSIG(status)})
        else:
            _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
        _close(conn, selector, children)


def _from_shim(conn: socket.socket, selector: selectors.BaseSelector, children: Children) -> None:
    pid = children[conn]
    try:
        data = conn.recv(4096)
    except OSError:
        data = b""
    if not data:  # TorchServe killed the shim (scale-down, restart): the child goes too
        _kill(pid, signal.SIGKILL)
        _close(conn, selector, children)
        return
    for line in data.splitlines():
        try:
            _kill(pid, int(json.loads(line)["signal"]))
        except (ValueError, KeyError, TypeError):
            pass


def _close(conn: socket.socket, selector: selectors.BaseSelector, children: Children) -> None:
    selector.unregister(conn)
    children.pop(conn, None)
    conn.close()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def become_worker(request: WorkerRequest, base_path: list[str]) -> None:
    """In the forked child: take the request's descriptors, directory, environment, argv; run it.

    `base_path` is the interpreter's own sys.path (without the fork server's start directory).
    """
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a new process
    # Moved out of the way first: a received descriptor may already sit on another's target.
    moved = [os.dup(fd) for fd in request.fds]
    for fd in request.fds:
        os.close(fd)
    for fd, target in zip(moved, request.targets):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    sys.dont_write_bytecode = bool(request.env.get("PYTHONDONTWRITEBYTECODE"))  # read at start-up
    import packrat.forkserver

    packrat.forkserver.FORKED = True
    module = request.argv[1] if request.argv[0] == "-m" else None
    # What a fresh `python script` (or `python -m module`) would have first on its path: the
    # script's directory (the working directory), then PYTHONPATH, then the interpreter's own.
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(request.argv[0]))
    extra = [p for p in request.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *[p for p in base_path if p not in extra]]
    if "numpy" in sys.modules:  # a fresh process draws its own seed; a fork inherits ours
        sys.modules["numpy"].random.seed()
    if module:
        sys.argv = [module, *request.argv[2:]]  # run_module puts the module's file in argv[0]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(request.argv)
        runpy.run_path(os.path.abspath(request.argv[0]), run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--parent", type=int, required=True, help="exit when this process exits")
    parser.add_argument("--preload", default=",".join(BASE_PRELOAD),
                        help="comma-separated modules to import before forking")
    parser.add_argument("--idle-preload", default="",
                        help="comma-separated modules to import one at a time while no request waits")
    args = parser.parse_args(argv)
    preload = tuple(m for m in args.preload.split(",") if m)
    idle_preload = tuple(m for m in args.idle_preload.split(",") if m)
    # `-m` put our start directory first; a worker gets its script's directory there instead.
    base_path = sys.path[1:] if sys.path and sys.path[0] in ("", os.getcwd()) else list(sys.path)
    become_worker(serve(args.socket, args.parent, preload, idle_preload), base_path)


if __name__ == "__main__":
    main()
