"""Start and stop a real TorchServe 0.12 process (tests, `make run`, the controller).

Several servers may run at once on one machine (parallel tests, a demo next to
a test run), so everything an instance writes is kept inside its own workdir:

- `torchserve --start` refuses to run when its pid file
  (`$TMPDIR/.model_server.pid`) names a live server, and `torchserve --stop`
  stops whichever server that file names. Each instance therefore gets its own
  TMPDIR, and we stop it ourselves by process group, never with `--stop`.
- Workers talk to the frontend over unix sockets `<java.io.tmpdir>/.ts.sock.<port>`
  with ports from 9000 up; TEMP (-> java.io.tmpdir) is per instance too.
- `key_file.json` and `logs/` land in the frontend's working directory = workdir.
- Slot locks and worker status files (packrat.slots) go to PACKRAT_SLOT_DIR.
  By default that is the per-user `$TMPDIR/packrat-slots-<uid>`, where a
  controller started separately (`make run`) finds them by the same rule;
  `slot_dir=` gives a server its own directory (tests: one per server, inside
  its workdir, removed by stop()). A controller of such a server must read
  that directory: run it with PACKRAT_SLOT_DIR=server.slot_dir.
- gRPC is always started (no switch in 0.12): its two ports are chosen free too.

The launcher runs `torchserve --foreground` as a child in a new session (through
packrat.forkserver.launch unless PACKRAT_FORKSERVER=0), so the launcher, the fork
server, the Java frontend and every Python worker share one process group;
stop() signals that group and waits until no member is left (SIGKILL after a
grace period), which leaves no Java behind even when several servers run.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from packrat import forkserver, settings
from packrat.apply.client import session_for
from packrat.apply.keys import KEY_FILE_NAME, Keys, read_keys
from packrat.errors import ServerError, TorchServeError
from packrat.tslog import with_log_config

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "config.properties"
STATE_FILE = "server.json"
# A cold JVM plus model-store scan takes ~5-15 s on 2 busy cores; leave room.
DEFAULT_START_TIMEOUT_S = 180.0
# The workers' slot directory variable (packrat.slots reads it in each worker).
SLOT_ENV: str = settings.get("slot_dir").env  # type: ignore[assignment]


@dataclass(frozen=True)
class Ports:
    inference: int
    management: int
    metrics: int
    grpc_inference: int
    grpc_management: int

    @staticmethod
    def free() -> "Ports":
        return Ports(*free_ports(5))

    @staticmethod
    def fixed_from(props: dict[str, str]) -> "Ports":
        """The ports a config.properties asks for (TorchServe's defaults where absent)."""

        def port(key: str, default: int) -> int:
            raw = props.get(key)
            return int(raw.rsplit(":", 1)[1]) if raw else default

        # Nobody here uses gRPC, but 0.12 always binds it and shuts down when
        # 7070/7071 are taken (e.g. by another TorchServe): free ones unless set.
        grpc = free_ports(2)
        return Ports(
            inference=port("inference_address", 8080),
            management=port("management_address", 8081),
            metrics=port("metrics_address", 8082),
            grpc_inference=int(props.get("grpc_inference_port", grpc[0])),
            grpc_management=int(props.get("grpc_management_port", grpc[1])),
        )


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def read_properties(path: Path) -> dict[str, str]:
    props: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            props[k.strip()] = v.strip()
    return props


def render_properties(
    template: Path, ports: Ports, model_store: Path, extra: dict[str, str] | None
) -> str:
    """The template with addresses, ports and model store overridden, extras appended."""
    overrides = {
        "inference_address": f"http://127.0.0.1:{ports.inference}",
        "management_address": f"http://127.0.0.1:{ports.management}",
        "metrics_address": f"http://127.0.0.1:{ports.metrics}",
        "grpc_inference_address": "127.0.0.1",
        "grpc_management_address": "127.0.0.1",
        "grpc_inference_port": str(ports.grpc_inference),
        "grpc_management_port": str(ports.grpc_management),
        "model_store": str(Path(model_store).resolve()),
    }
    # The template's plugins_path (the Packrat endpoint plugin) is relative to the
    # template's directory; the frontend runs in its workdir, so pass it absolute.
    plugins = read_properties(template).get("plugins_path")
    if plugins and not Path(plugins).is_absolute():
        overrides["plugins_path"] = str(Path(template).resolve().parent / plugins)
    for k, v in (extra or {}).items():
        overrides[k] = str(v)
    out, seen = [], set()
    for line in Path(template).read_text().splitlines():
        key = line.split("=", 1)[0].strip() if "=" in line and not line.lstrip().startswith("#") else None
        if key in overrides:
            out.append(f"{key}={overrides[key]}")
            seen.add(key)
        else:
            out.append(line)
    out += ["", "# set by packrat.server"]
    out += [f"{k}={v}" for k, v in overrides.items() if k not in seen]
    return "\n".join(out) + "\n"


@dataclass
class RunningServer:
    """A TorchServe instance started by start_torchserve() (or attached from its workdir)."""

    workdir: Path
    model_store: Path
    pid: int  # the launcher's pid; it leads the process group
    ports: Ports
    config_path: Path
    # The workers' PACKRAT_SLOT_DIR (slot locks, status files); None: not recorded.
    slot_dir: Path | None = None
    _proc: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    @property
    def inference_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.inference}"

    @property
    def management_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.management}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}"

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def keys(self) -> Keys:
        # Re-read every time: TorchServe rewrites the file when a key is regenerated.
        return read_keys(self.key_file)

    def inference_headers(self) -> dict[str, str]:
        return self.keys.inference_headers()

    def management_headers(self) -> dict[str, str]:
        return self.keys.management_headers()

    @property
    def key_file(self) -> Path:
        return self.workdir / KEY_FILE_NAME

    def management_client(self):
        """A ManagementClient for this server (re-reads the key file as TorchServe rotates it)."""
        from packrat.apply.client import ManagementClient

        return ManagementClient(self.management_url, self.key_file)

    def register(self, name: str, workers: int = 1, timeout_s: float = 600.0) -> list[dict]:
        """Register archive `name` from the model store and wait until `workers` are READY.

        Asynchronous register + polling describe (a synchronous register blocks a
        Netty thread that inference connections share, see ManagementClient.register).
        Returns the workers (id, pid, status).
        """
        self.management_client().register(name, name, workers, synchronous=False)
        return self.wait_ready(name, workers, timeout_s)

    def wait_ready(self, name: str, workers: int = 1, timeout_s: float = 600.0) -> list[dict]:
        """Wait until `workers` of registered model `name` are READY (one loaded at start with
        --models, one registered asynchronously); returns them (id, pid, status)."""
        client = self.management_client()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                found = client.describe(name).get("workers", [])
            except TorchServeError:
                found = []  # not visible yet
            ready = [w for w in found if w.get("status") == "READY"]
            if len(ready) >= workers:
                return ready
            if time.monotonic() > deadline or not self.is_running():
                raise ServerError(
                    f"{name}: {len(ready)}/{workers} workers READY after {timeout_s:.0f}s: {found}\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.3)

    def is_running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return _group_alive(self.pid)

    def log_tail(self, lines: int = 60) -> str:
        return _log_tail(self.workdir, lines)

    # -- lifecycle -----------------------------------------------------------

    def save(self) -> None:
        state = {
            "workdir": str(self.workdir),
            "model_store": str(self.model_store),
            "pid": self.pid,
            "ports": asdict(self.ports),
            "config_path": str(self.config_path),
            "slot_dir": None if self.slot_dir is None else str(self.slot_dir),
        }
        (self.workdir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    @staticmethod
    def attach(workdir: Path) -> "RunningServer":
        """The server whose state start_torchserve() saved in `workdir` (e.g. for `make stop`)."""
        state = json.loads((Path(workdir) / STATE_FILE).read_text())
        return RunningServer(
            workdir=Path(state["workdir"]),
            model_store=Path(state["model_store"]),
            pid=int(state["pid"]),
            ports=Ports(**state["ports"]),
            config_path=Path(state["config_path"]),
            slot_dir=Path(state["slot_dir"]) if state.get("slot_dir") else None,
        )

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the frontend and all its workers; idempotent.

        SIGTERM lets the JVM run its shutdown hook (it stops the workers);
        whatever is left after the grace period is SIGKILLed.
        """
        _signal_group(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None:
                self._proc.poll()  # reap the launcher so it stops counting as alive
            if not _group_alive(self.pid):
                break
            time.sleep(0.2)
        else:
            _signal_group(self.pid, signal.SIGKILL)
            for _ in range(50):
                if self._proc is not None:
                    self._proc.poll()
                if not _group_alive(self.pid):
                    break
                time.sleep(0.1)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        (self.workdir / STATE_FILE).unlink(missing_ok=True)
        # A private slot dir (inside the workdir) dies with its server: stale locks
        # and status files of dead workers must not meet the next server there.
        if self.slot_dir is not None and self.slot_dir.is_relative_to(self.workdir):
            shutil.rmtree(self.slot_dir, ignore_errors=True)

    def __enter__(self) -> "RunningServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """True while any process (not a zombie) of the process group exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg succeeds on zombies too; look for a live member.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the ")" of comm: state ppid pgrp ...
        rest = stat.rsplit(")", 1)[1].split()
        if int(rest[2]) == pgid and rest[0] != "Z":
            return True
    return False


LOGS = ("torchserve.out", "logs/ts_log.log", "logs/model_log.log")


def _log_sizes(workdir: Path) -> dict[str, int]:
    """Where each log ends now: a start's lines are those written after (the files are appended to)."""
    return {name: (workdir / name).stat().st_size if (workdir / name).exists() else 0 for name in LOGS}


def _log_tail(workdir: Path, lines: int, since: Mapping[str, int] | None = None) -> str:
    """The last `lines` of each log; with `since` (_log_sizes), of what was written after it only."""
    parts = []
    for name in LOGS:
        path = workdir / name
        if not path.exists():
            continue
        with open(path, "rb") as f:
            at = (since or {}).get(name, 0)
            f.seek(at if at <= path.stat().st_size else 0)  # a log rolled over since: all of it
            text = f.read().decode(errors="replace").splitlines()[-lines:]
        if text or since is None:
            parts.append(f"--- {path} (last {len(text)} lines{' of this start' if since else ''})\n" + "\n".join(text))
    return "\n".join(parts) or f"(no logs in {workdir})"


def bind_reusing(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port the way TorchServe's Netty and uvicorn bind (address
    reuse on: a port whose last connections are in TIME_WAIT is free); OSError if it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


def taken_ports(ports: Ports) -> list[tuple[str, int, str]]:
    """(property, port, why) of each of `ports` that cannot be bound at 127.0.0.1 (in use,
    or below 1024 for a user without the right): each bound as the frontend binds, then let go."""
    named = [("inference_address", ports.inference), ("management_address", ports.management),
             ("metrics_address", ports.metrics), ("grpc_inference_port", ports.grpc_inference),
             ("grpc_management_port", ports.grpc_management)]
    out = []
    for prop, port in named:
        try:
            bind_reusing("127.0.0.1", port).close()
        except OSError as exc:
            out.append((prop, port, "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror))
    return out


def _torchserve_command(env: dict[str, str]) -> list[str]:
    if forkserver.enabled(env):  # workers forked warm (packrat/forkserver), else TorchServe's own start
        return [sys.executable, "-m", "packrat.forkserver.launch", "--"]
    script = Path(sys.executable).parent / "torchserve"
    # TorchServe starts its workers with the launcher's sys.executable: this venv,
    # where `packrat` and the handler's dependencies are installed.
    return [str(script)] if script.exists() else [sys.executable, "-m", "ts.model_server"]


def start_torchserve(
    model_store: Path,
    workdir: Path,
    config_template: Path = DEFAULT_CONFIG,
    ports: Ports | None = None,
    extra_properties: dict[str, str] | None = None,
    models: list[str] | None = None,
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    env: dict[str, str] | None = None,
    slot_dir: Path | str | None = None,
) -> RunningServer:
    """Start TorchServe, wait until /ping is healthy, return the running server.

    `ports` defaults to free loopback ports; pass Ports.fixed_from(...) to keep
    the template's. `models` is passed as `--models` (names in the model store).
    `slot_dir` is the workers' PACKRAT_SLOT_DIR (None: the environment's, else
    the machine-wide default); one inside `workdir` is removed by stop().
    On failure the process group is killed and ServerError carries the log tail.
    """
    workdir = Path(workdir).resolve()
    model_store = Path(model_store).resolve()
    if not model_store.is_dir():
        raise ServerError(f"{model_store}: model store directory does not exist")
    ports = ports or Ports.free()
    taken = taken_ports(ports)
    if taken:  # else the frontend fails after seconds, its cause among a hundred log lines
        where = "; ".join(f"port {port} ({prop}) {why}" for prop, port, why in taken)
        raise ServerError(
            f"{where} on 127.0.0.1 (`ss -ltnp 'sport = :{taken[0][1]}'` names a process listening there): "
            "stop it, or start on free ports: `packrat torchserve start --free-ports` "
            "(`PACKRAT_FREE_PORTS=1 make run`)")
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = workdir / "tmp"
    tmp.mkdir(exist_ok=True)
    (workdir / "key_file.json").unlink(missing_ok=True)  # a stale file would hand out dead keys
    config_path = workdir / "config.properties"
    config_path.write_text(render_properties(config_template, ports, model_store, extra_properties))

    child_env = _child_env(os.environ if env is None else env, slot_dir, tmp)
    cmd = _torchserve_command(child_env) + [
        "--start",
        "--foreground",
        "--ncs",
        "--ts-config",
        str(config_path),
        "--model-store",
        str(model_store),
    ]
    if models:
        cmd += ["--models", *models]
    cmd = with_log_config(cmd, child_env)  # packrat/log4j2.xml: no per-request log lines
    since = _log_sizes(workdir)
    proc = _launch(cmd, workdir, child_env)
    server = RunningServer(
        workdir=workdir,
        model_store=model_store,
        pid=proc.pid,
        ports=ports,
        config_path=config_path,
        slot_dir=Path(child_env[SLOT_ENV]),
        _proc=proc,
    )
    server.save()
    try:
        _wait_healthy(server, timeout_s, since)
    except BaseException:
        server.stop(timeout_s=10)
        raise
    return server


def _child_env(base: Mapping[str, str], slot_dir: Path | str | None, tmp: Path) -> dict[str, str]:
    """The environment TorchServe starts with: `base`, its slot dir and its own temp dir."""
    child_env = dict(base)
    if slot_dir is not None:
        # Created by the first worker (packrat.slots sets its permissions).
        child_env[SLOT_ENV] = str(Path(slot_dir).resolve())
    else:
        # Not the per-instance TMPDIR below: a controller started on its own must
        # find the same directory by the same rule (packrat.slots.slot_root()).
        child_env[SLOT_ENV] = str(settings.value("slot_dir", env=child_env))
    child_env["TMPDIR"] = str(tmp)  # launcher pid file
    child_env["TEMP"] = str(tmp)  # -> -Djava.io.tmpdir: worker unix sockets
    child_env.pop("TS_CONFIG_FILE", None)  # would override --ts-config
    return child_env


def _launch(cmd: list[str], workdir: Path, child_env: dict[str, str]) -> subprocess.Popen:
    """Start `cmd` in its own process group, output appended to <workdir>/torchserve.out."""
    out = open(workdir / "torchserve.out", "ab")
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() signals exactly this server
        )
    finally:
        out.close()
    return proc


# Printed by the frontend after every listener, gRPC included, is bound. /ping
# answers earlier (HTTP binds first), and a failed gRPC bind then shuts the
# server down, so healthy means: ping OK *and* this line seen.
STARTED_LINE = b"Model server started."


def _started(server: RunningServer, offset: int) -> bool:
    try:
        with open(server.workdir / "torchserve.out", "rb") as f:
            f.seek(offset)
            return STARTED_LINE in f.read()
    except OSError:
        return False


def _wait_healthy(server: RunningServer, timeout_s: float, since: Mapping[str, int]) -> None:
    """Until /ping answers and the frontend said it started; `since`: where this start's
    lines begin in each log (_log_sizes), the tail a failure shows."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    # Not through a proxy named in the environment: the ping carries the inference key.
    with session_for(server.inference_url) as session:
        while time.monotonic() < deadline:
            if not server.is_running():
                raise ServerError(f"TorchServe exited during start-up\n{_log_tail(server.workdir, 60, since)}")
            # In 0.12 /ping itself needs the inference token (HTTP 400 without it),
            # and key_file.json appears only once the frontend is up.
            if not (server.workdir / "key_file.json").exists():
                time.sleep(0.3)
                continue
            try:
                r = session.get(f"{server.inference_url}/ping", headers=server.inference_headers(), timeout=2)
                if r.status_code == 200 and r.json().get("status") == "Healthy":
                    if _started(server, since["torchserve.out"]):
                        return
                    last = "ping healthy, waiting for 'Model server started.'"
                else:
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
            except (requests.RequestException, ValueError, TorchServeError) as exc:
                last = str(exc)
            time.sleep(0.3)
    raise ServerError(f"{server.inference_url}/ping not healthy after {timeout_s:.0f}s ({last})\n"
                      f"{_log_tail(server.workdir, 60, since)}")
