"""Helpers for serving tests: start a server, register once per server, predict, worker pids."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from packrat.server import RunningServer, start_torchserve
from waiting import wait_until


def start_server(model_store: Path, workdir: Path, **kwargs) -> RunningServer:
    """start_torchserve with the server's own slot directory (inside `workdir`,
    removed by stop()): no test server sees another's slot locks or status files.
    Whatever reads its workers' status files (a Swapper in the test process, a
    controller subprocess) must use PACKRAT_SLOT_DIR=server.slot_dir."""
    return start_torchserve(model_store, workdir, slot_dir=Path(workdir) / "slots", **kwargs)


# Servers stopping on threads of their own (stop_in_background), joined at session end.
_background_stops: list[tuple[RunningServer, threading.Thread, list[BaseException]]] = []
_background_lock = threading.Lock()
_background_open = False  # only while conftest's session fixture will join them


def stop_in_background(server: RunningServer) -> None:
    """server.stop() on a thread of its own, for a server nothing uses again.

    A stop takes ~2.5 s of waiting (TorchServe's shutdown hook sits out Netty's fixed
    2 s quiet period) and almost no CPU; the next test need not wait for it. Only for a
    server whose workdir, ports and slot dir no later test takes (start_server gives
    each its own) and whose logs and processes nothing reads after. conftest's
    session fixture joins every one (background_stops_joined) and fails the run if a
    stop raised or left a process of its group. Outside that (no session fixture
    active) the stop is synchronous."""
    with _background_lock:
        if _background_open:
            errors: list[BaseException] = []

            def stop() -> None:
                try:
                    server.stop()
                except BaseException as exc:  # kept for background_stops_joined to report
                    errors.append(exc)

            # Not a daemon: an interpreter leaving early still waits for the JVM to go.
            thread = threading.Thread(target=stop, name=f"stop-torchserve-{server.pid}")
            thread.start()
            _background_stops.append((server, thread, errors))
            return
    server.stop()


@contextmanager
def background_stops_joined(timeout_s: float = 120.0) -> Iterator[None]:
    """While inside, stop_in_background stops on a thread; on leaving, every such stop is
    joined and AssertionError names each that raised, outlived `timeout_s` (stop()
    itself SIGKILLs after 60 s) or left a live process in the server's process group."""
    global _background_open
    from packrat.bench.proc_cpu import group_members

    with _background_lock:
        _background_open = True
    try:
        yield
    finally:
        with _background_lock:
            _background_open = False  # from here on, stops are synchronous
            stops = list(_background_stops)
            _background_stops.clear()
        problems = []
        for server, thread, errors in stops:
            thread.join(timeout_s)
            if thread.is_alive():
                problems.append(f"{server.workdir}: stop() still running after {timeout_s:.0f} s")
            problems += [f"{server.workdir}: stop() raised {exc!r}" for exc in errors]
            if left := group_members(server.pid):  # independent of stop()'s own check
                problems.append(f"{server.workdir}: processes {left} of group {server.pid} left after stop()")
        assert not problems, "background stops of TorchServe failed:\n" + "\n".join(problems)


def usable_cores(n: int = 2) -> tuple[int, ...]:
    """The first `n` CPUs this process may run on (not 0 and 1: a CI container may be
    pinned to others); skips the test, saying why, where fewer are usable."""
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < n:
        pytest.skip(f"needs {n} usable CPUs, this process may run on {len(usable)}: {usable}")
    return tuple(usable[:n])


def cpu_list(cores: tuple[int, ...] | list[int]) -> str:
    """(2, 5) -> '2,5', for a --cores option."""
    return ",".join(str(c) for c in cores)


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def ensure_registered(server: RunningServer, *names: str) -> None:
    """Register the archives not yet loaded, in parallel: each worker spends ~5-10 s
    importing torch/transformers, and TorchServe loads models concurrently."""
    loaded = {m["modelName"] for m in server.management_client().list_models()}
    todo = [n for n in names if n not in loaded]
    if todo:
        with ThreadPoolExecutor(len(todo)) as pool:
            for f in [pool.submit(server.register, n) for n in todo]:
                f.result()


def worker_pids(server: RunningServer, name: str) -> list[int]:
    return [w["pid"] for w in server.management_client().describe(name)["workers"]]


def predict(server: RunningServer, name: str, body: bytes | None = None, json: object = None,
            headers: dict[str, str] | None = None) -> requests.Response:
    h = server.inference_headers()
    h.update(headers or {})
    return requests.post(f"{server.inference_url}/predictions/{name}", data=body, json=json,
                         headers=h, timeout=120)


def predict_together(server: RunningServer, name: str, payloads: list[dict]) -> list[requests.Response]:
    """Send all payloads at once (one thread each, released together) so TorchServe can batch them."""
    start = threading.Barrier(len(payloads))

    def send(p: dict) -> requests.Response:
        start.wait(60)
        return predict(server, name, **p)

    with ThreadPoolExecutor(len(payloads)) as pool:
        futures = [pool.submit(send, p) for p in payloads]
        return [f.result() for f in futures]


def predict_batched(server: RunningServer, name: str, payloads: list[dict],
                    timeout_s: float = 180.0) -> list[requests.Response]:
    """predict_together until TorchServe put all of them in one batch (each answer's
    x-packrat-batch-size says so). The batch window is short (300 ms in the test
    archives): on a busy machine a try may miss it, so it is tried again; only a server
    that never batches them within `timeout_s` fails (a hang guard, not a speed bound)."""
    sizes: list = []

    def batched() -> list[requests.Response] | None:
        responses = predict_together(server, name, payloads)
        sizes.append([r.headers.get("x-packrat-batch-size") for r in responses])
        return responses if set(sizes[-1]) == {str(len(payloads))} else None

    try:
        return wait_until(batched, timeout_s, f"{len(payloads)} requests to {name} batched together", step_s=0.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; batch sizes seen, last tries: {sizes[-5:]}") from None


class ControllerProcess:
    """One `packrat controller` subprocess attached to a test server; restartable.

    `extra` are the test's own flags (e.g. --no-adapt, --no-tune). It reads
    the workers' status files in the server's own slot directory, and is
    killed with its whole process group (profiling workers included).
    """

    def __init__(self, server: RunningServer, store: Path, state: Path, extra: list[str],
                 port: int | None = None, ready_path: str = "/metrics", start_timeout_s: float = 180.0) -> None:
        from packrat.server import free_ports

        self.server, self.store, self.state, self.extra = server, store, state, list(extra)
        self.port = port if port is not None else free_ports(1)[0]
        self.ready_path, self.start_timeout_s = ready_path, start_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self, state: Path | None = None, port: int | None = None) -> subprocess.Popen:
        """Start a controller process (on another state dir or port if given); do not wait."""
        state = state or self.state
        cmd = [sys.executable, "-m", "packrat.cli", "controller",
               "--management-url", self.server.management_url, "--metrics-url", self.server.metrics_url,
               "--key-file", str(self.server.key_file), "--model-store", str(self.store),
               "--state-dir", str(state), "--cores", cpu_list(usable_cores(2)),
               "--port", str(port or self.port), *self.extra]
        state.mkdir(parents=True, exist_ok=True)
        log = open(state / "controller.out", "ab")
        env = dict(os.environ, PACKRAT_SLOT_DIR=str(self.server.slot_dir))
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def start(self) -> None:
        """Spawn and wait until the API answers (a hang guard, not a speed bound: imports
        alone take long on a busy machine)."""
        self.proc = self.spawn()

        def answers() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                requests.get(f"{self.url}{self.ready_path}", timeout=10)
                return True
            except (requests.ConnectionError, requests.Timeout):  # not listening, or busy importing
                return False

        try:
            wait_until(answers, self.start_timeout_s, "the controller's API to answer", step_s=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log()}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log(self, tail: int = 3000) -> str:
        return (self.state / "controller.out").read_text()[-tail:]

    def headers(self) -> dict[str, str]:
        return self.server.management_headers()

    def get(self, path: str, **kw) -> requests.Response:
        kw.setdefault("timeout", 60)
        return requests.get(f"{self.url}{path}", headers=self.headers(), **kw)


def synthetic_profile(model_id: str = "synthetic"):
    """A small profile without counts (taken as exact): plans get a predicted latency
    (the noop archive's own is a few ms), 2 threads 1.6x faster than 1."""
    from packrat.types import Profile, ProfilePoint

    points = tuple(ProfilePoint(threads=t, batch=b, mean_ms=round(4.0 * b ** 0.8 / (1.6 if t == 2 else 1.0), 3))
                   for t in (1, 2) for b in (1, 2, 4))
    return Profile(model_id=model_id, points=points)


@contextmanager
def noop_with_controller(tiny_store: Path, workdir: Path, model: str, controller_flags: list[str],
                         profiled: bool = True) -> Iterator[tuple[RunningServer, ControllerProcess]]:
    """TorchServe serving the noop archive as `model` (registered, one worker) and a
    `packrat controller` beside it with `controller_flags`, up once /healthz answers;
    with `profiled`, the model has synthetic_profile() in the controller's state.
    Both are stopped on the way out, also on failure (TorchServe in the background)."""
    from packrat.profile.store import save_profile

    store, state = workdir / "store", workdir / "state"
    store.mkdir(parents=True)
    state.mkdir(parents=True)
    (store / model).symlink_to(tiny_store / "noop", target_is_directory=True)
    if profiled:
        save_profile(synthetic_profile(), state / "profiles" / f"{model}.json")
    server = start_server(store, workdir / "ts")
    ctl = ControllerProcess(server, store, state, controller_flags, ready_path="/healthz")
    with registered_with_controller(server, ctl, model) as stack:
        yield stack


@contextmanager
def registered_with_controller(server: RunningServer, ctl: ControllerProcess,
                               model: str) -> Iterator[tuple[RunningServer, ControllerProcess]]:
    """Register `model` (one worker) on a started `server`, then start `ctl`; both are
    stopped on the way out, also when registering or starting fails (the controller
    killed at once, TorchServe by stop_in_background)."""
    try:
        server.management_client().register(model, model, 1)
        ctl.start()
        yield server, ctl
    finally:
        ctl.kill()
        stop_in_background(server)  # its own workdir, ports and slot dir: nothing uses them again


@contextmanager
def swapper_on_a_copy(tiny_store: Path, tmp_factory: pytest.TempPathFactory, base: str,
                      name: str) -> Iterator[tuple[RunningServer, Path, object]]:
    """A TorchServe of its own over a copy of the tiny archive `base` registered as `name`,
    and a Swapper for it: (server, model store, swapper). The server stops on the way out
    (stop_in_background)."""
    import shutil

    from packrat.apply.swap import Swapper

    store = tmp_factory.mktemp(f"{name}-store")
    shutil.copytree(tiny_store / base, store / name, symlinks=True)
    server = start_server(store, tmp_factory.mktemp(f"{name}-ts"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PACKRAT_SLOT_DIR", str(server.slot_dir))  # the Swapper reads the status files
            client = server.management_client()
            client.register(name, name, 1)
            yield server, store, Swapper(client, store, cores=list(usable_cores(2)))
    finally:
        stop_in_background(server)


def python_for(uid: int) -> str:
    """An interpreter `uid` may run (the venv's may sit in a directory only its owner enters)."""
    for candidate in (sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"):
        try:
            subprocess.run([candidate, "-c", ""], user=uid, group=uid, check=True, timeout=30)
            return candidate
        except (OSError, subprocess.CalledProcessError):
            continue
    pytest.skip(f"no Python that uid {uid} may run")


@contextmanager
def http_stand_in(answer) -> Iterator[tuple[str, list[tuple[str, str, str | None]]]]:
    """A stand-in server on a free loopback port for what a CLI command asks (the controller,
    or another server on its port): `answer(method, path)` gives (status, content type,
    body) and optionally a dict of further headers. Yields (its URL, the requests it got as
    (method, path, Authorization header)); stopped on leaving, also on failure."""
    import http.server

    asked: list[tuple[str, str, str | None]] = []

    class StandIn(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            asked.append((self.command, self.path, self.headers.get("Authorization")))
            status, content_type, body, *more = answer(self.command, self.path)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            for name, value in (more[0] if more else {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = _answer

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
