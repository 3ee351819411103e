"""Workers forked from a warm interpreter (packrat/forkserver): the shim and the fork
server as processes, then through a real TorchServe."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from PIL import Image

from packrat.bench.fault_drill import jvms
from packrat.errors import TorchServeError
from packrat.forkserver import write_shim
from packrat.server import DEFAULT_CONFIG, Ports, RunningServer, render_properties
from serving_support import ensure_registered, process_alive, start_server, stop_in_background
from waiting import wait_until

# Prints what a fresh `python worker.py` would see, then behaves as its argv asks.
WORKER = """\
import json, os, sys, time
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
                  "flavour": os.environ.get("FLAVOUR"), "path": sys.path[:2],
                  "nice": os.getpriority(os.PRIO_PROCESS, 0)}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "sleep":
    time.sleep(120)
sys.exit(int(sys.argv[1]))
"""


def _parent_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


def _wait_gone(pid: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not process_alive(pid)


def _nice_of(pid: int, tid: str) -> int:
    # /proc/<pid>/task/<tid>/stat: the 19th field is the thread's nice (after "(comm)").
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def _healthy(server: RunningServer) -> bool:
    try:  # 0.12's /ping wants the inference token too
        return requests.get(f"{server.inference_url}/ping", headers=server.inference_headers(),
                            timeout=5).status_code == 200
    except (requests.ConnectionError, TorchServeError):
        return False


def _kill_groups_of(marker: str) -> None:
    """SIGKILL the process group of every process whose command line holds `marker`."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                os.killpg(os.getpgid(int(entry.name)), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


@pytest.fixture
def fork_server(tmp_path: Path):
    """A fork server (preloading only json: the protocol, not torch) and its shim."""
    socket_path = tmp_path / "sock"
    proc = subprocess.Popen([sys.executable, "-m", "packrat.forkserver.server", "--socket", str(socket_path),
                             "--parent", str(os.getpid()), "--preload", "json"], stderr=subprocess.PIPE)
    shim = tmp_path / "python"
    assert write_shim(shim, sys.executable, str(socket_path))
    def listening() -> bool:
        assert proc.poll() is None, f"the fork server exited: {proc.stderr.read().decode()[-2000:]}"
        return socket_path.exists()
    wait_until(listening, 120, "the fork server's socket")
    (tmp_path / "worker.py").write_text(WORKER)
    try:
        yield proc, shim, tmp_path / "worker.py"
    finally:
        proc.kill()
        proc.wait()


def _start(shim: Path, script: Path, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([str(shim), str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def test_a_forked_worker_gets_the_callers_argv_env_cwd_stdio_and_exit_code(fork_server, tmp_path) -> None:
    server, shim, script = fork_server
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    env = {**os.environ, "FLAVOUR": "vanilla", "PYTHONPATH": "/nonexistent/extra"}
    run = _start(shim, script, "3", cwd=workdir, env=env)
    out, err = run.communicate(timeout=60)
    seen = json.loads(out)
    assert run.returncode == 3
    assert seen["ppid"] == server.pid  # forked by the fork server, not exec'd by the shim
    assert seen["pid"] != run.pid
    assert seen["argv"] == [str(script), "3"]
    assert seen["cwd"] == str(workdir)
    assert seen["flavour"] == "vanilla"
    assert seen["path"] == [str(script.parent), "/nonexistent/extra"]
    assert "to stderr" in err


def test_killing_the_shim_kills_its_worker_and_a_signal_comes_back_as_the_status(fork_server) -> None:
    server, shim, script = fork_server
    killed = _start(shim, script, "sleep")
    worker = json.loads(killed.stdout.readline())["pid"]
    killed.kill()  # what TorchServe does to a worker it scales down
    killed.wait(timeout=10)
    assert _wait_gone(worker)

    termed = _start(shim, script, "sleep")
    worker = json.loads(termed.stdout.readline())["pid"]
    termed.terminate()  # forwarded: the worker dies of SIGTERM, and so does the shim
    assert termed.wait(timeout=10) == -signal.SIGTERM
    assert _wait_gone(worker)
    assert server.poll() is None


def test_a_worker_dying_while_the_server_is_busy_leaves_the_other_workers_alone(fork_server) -> None:
    """A worker killed while the server is busy, and TorchServe killing its shim for it (what
    it does when a worker dies), reach the server together: its SIGCHLD and the shim's
    closed connection in one select(). Handling the first must not trip over the second:
    a crashed fork server took every worker it forked down with it (PDEATHSIG, before
    workers outlived it), the workers of other models included (make test in CI lost a
    bystander's request so); it still leaves later starts cold until the next one is up."""
    import socket

    server, shim, script = fork_server
    victim_shim = _start(shim, script, "sleep")
    victim = json.loads(victim_shim.stdout.readline())["pid"]
    bystander_shim = _start(shim, script, "sleep")
    bystander = json.loads(bystander_shim.stdout.readline())["pid"]
    # A caller that connects and says nothing holds the one-threaded server in its read
    # (up to its request timeout), so both events below wait for the same select().
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.connect(str(script.parent / "sock"))
    time.sleep(0.3)
    os.kill(victim, signal.SIGKILL)  # SIGCHLD first...
    time.sleep(0.3)
    victim_shim.kill()  # ...then the shim's connection closes
    victim_shim.wait(timeout=10)
    time.sleep(0.3)
    holder.close()
    time.sleep(1.0)
    assert server.poll() is None, server.stderr.read().decode()[-2000:]
    assert process_alive(bystander) and bystander_shim.poll() is None
    # And it still forks.
    again = _start(shim, script, "4")
    out, _ = again.communicate(timeout=60)
    assert again.returncode == 4 and json.loads(out.splitlines()[0])["ppid"] == server.pid
    bystander_shim.kill()
    assert _wait_gone(bystander)


# `python -m probe_module RESULT_FD`: what it saw, written to the descriptor it was given.
PROBE_MODULE = """\
import json, os, sys
import packrat.forkserver
os.write(int(sys.argv[1]), json.dumps({"ppid": os.getppid(), "argv": sys.argv, "path0": sys.path[0],
    "forked": packrat.forkserver.FORKED, "stdin": sys.stdin.read(),
    "no_bytecode": sys.dont_write_bytecode}).encode())
sys.exit(7 if sys.argv[2:] == ["fail"] else 0)
"""


def test_a_process_asks_for_a_module_with_extra_descriptors_and_waits_or_kills(fork_server, tmp_path) -> None:
    """packrat.forkserver.client: `-m module`, descriptors mapped to chosen numbers, Popen's wait/kill."""
    from packrat.forkserver.client import request

    server, _shim, script = fork_server
    socket_path = str(script.parent / "sock")
    workdir = tmp_path / "mods"
    workdir.mkdir()
    (workdir / "probe_module.py").write_text(PROBE_MODULE)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    for args, status in (([], 0), (["fail"], 7)):
        stdin_r, stdin_w = os.pipe()
        os.write(stdin_w, b"from the caller")
        os.close(stdin_w)
        result_r, result_w = os.pipe()
        proc = request(socket_path, ["-m", "probe_module", "5", *args], env, str(workdir),
                       fds={0: stdin_r, 1: 1, 2: 2, 5: result_w})
        os.close(stdin_r)
        os.close(result_w)
        assert proc is not None
        with os.fdopen(result_r) as results:
            seen = json.loads(results.read())
        assert proc.wait() == status
        assert seen["ppid"] == server.pid and seen["forked"] is True
        assert seen["argv"] == [str(workdir / "probe_module.py"), "5", *args]
        assert seen["path0"] == str(workdir) and seen["stdin"] == "from the caller"
        assert seen["no_bytecode"] is True

    result_r, result_w = os.pipe()
    sleeper = request(socket_path, [str(script), "sleep"], os.environ, str(tmp_path), fds={0: 0, 1: result_w, 2: 2})
    os.close(result_w)
    with os.fdopen(result_r) as out:
        worker = json.loads(out.readline())["pid"]
        sleeper.kill()
        assert sleeper.wait() == -signal.SIGKILL
    assert _wait_gone(worker)
    # A request it must not serve comes back as None: the caller starts Python itself.
    assert request(socket_path, ["-m", "no such module!"], os.environ, str(tmp_path), fds={0: 0, 1: 1, 2: 2}) is None
    assert request(str(tmp_path / "no-socket"), [str(script), "0"], os.environ, str(tmp_path),
                   fds={0: 0, 1: 1, 2: 2}) is None
    assert server.poll() is None


def test_the_shim_runs_python_itself_when_the_fork_server_is_gone_or_declines(fork_server) -> None:
    server, shim, script = fork_server
    # PYTHONHASHSEED is read when an interpreter starts: a fork cannot honour another one.
    declined = _start(shim, script, "0", env={**os.environ, "PYTHONHASHSEED": "7"})
    out, _ = declined.communicate(timeout=60)
    assert declined.returncode == 0
    assert json.loads(out)["pid"] == declined.pid  # exec'd in place

    server.kill()
    server.wait()
    cold = _start(shim, script, "5")
    out, _ = cold.communicate(timeout=60)
    assert cold.returncode == 5
    assert json.loads(out)["pid"] == cold.pid


def test_a_worker_outlives_its_killed_fork_server_and_its_shim_follows_it(fork_server) -> None:
    """A shim's worker does not die with the fork server (a killed one would otherwise take
    every worker TorchServe has down at once): the shim passes signals to it directly and
    ends when it ends. The profiler's children (client.request) still die with the server."""
    from packrat.forkserver.client import request

    server, shim, script = fork_server
    sock = str(shim.parent / "sock")
    waiting, ending, stopped = (_start(shim, script, "sleep") for _ in range(3))
    worker, other, third = (json.loads(p.stdout.readline())["pid"] for p in (waiting, ending, stopped))
    profiler_r, profiler_w = os.pipe()
    profiled = request(sock, [str(script), "sleep"], dict(os.environ), str(script.parent), {1: profiler_w})
    os.close(profiler_w)
    assert profiled is not None
    with os.fdopen(profiler_r) as out:
        assert json.loads(out.readline())["pid"] == profiled.pid
    server.kill()
    server.wait()
    assert profiled.wait() == -signal.SIGKILL
    assert _wait_gone(profiled.pid, timeout_s=10)
    time.sleep(0.5)
    for pid, its_shim in ((worker, waiting), (other, ending), (third, stopped)):
        assert process_alive(pid) and its_shim.poll() is None
        assert _parent_of(pid) != server.pid
    waiting.send_signal(signal.SIGTERM)  # what TorchServe sends a worker it stops: now straight to it
    assert waiting.wait(timeout=10) == -signal.SIGTERM
    assert _wait_gone(worker, timeout_s=10)
    assert process_alive(other) and ending.poll() is None
    os.kill(other, signal.SIGKILL)  # ended by itself: its status went with the server, the shim says 1
    assert ending.wait(timeout=10) == 1
    stopped.kill()  # how TorchServe 0.12 stops a worker (destroyForcibly): the child goes with its shim
    assert _wait_gone(third, timeout_s=10)


def test_a_worker_the_shim_starts_itself_goes_back_to_the_workers_nice(fork_server, tmp_path) -> None:
    # Where the frontend runs favoured (launch.favour_frontend), the shim inherits its nice;
    # a worker it execs itself (the fork server declined) must not keep it.
    _, _, script = fork_server
    workers_nice = os.getpriority(os.PRIO_PROCESS, 0) + 2
    shim = tmp_path / "python-nice"
    assert write_shim(shim, sys.executable, str(tmp_path / "sock"), worker_nice=workers_nice)
    declined = _start(shim, script, "0", env={**os.environ, "PYTHONHASHSEED": "7"})
    out, _ = declined.communicate(timeout=60)
    seen = json.loads(out)
    assert seen["pid"] == declined.pid and seen["nice"] == workers_nice
    forked = _start(shim, script, "0")  # the fork server's worker has the fork server's nice
    assert json.loads(forked.communicate(timeout=60)[0])["nice"] == os.getpriority(os.PRIO_PROCESS, 0)


# A module whose import takes `slow_s` of wall time (asleep, so a loaded machine does not
# stretch it) and logs when it ran: the fork server's background imports, made visible.
SLOW_MODULE = """\
import os, time
with open(os.environ["IMPORT_LOG"], "a") as log:
    log.write(f"{{__name__}} start {{time.time()}}\\n")
time.sleep({slow_s})
with open(os.environ["IMPORT_LOG"], "a") as log:
    log.write(f"{{__name__}} end {{time.time()}}\\n")
"""
# `python -m seen_module RESULT_FD`: when it was forked and which slow modules it has.
SEEN_MODULE = """\
import json, os, sys, time
os.write(int(sys.argv[1]), json.dumps({"at": time.time(), "ppid": os.getppid(),
    "slow": sorted(m for m in sys.modules if m.startswith("slow_"))}).encode())
"""


def _ask(socket_path: Path, workdir: Path, preload: tuple[str, ...] = ()) -> tuple[dict, float]:
    """Fork `seen_module` through `socket_path`: what it saw, and how long the request waited."""
    from packrat.forkserver.client import request

    result_r, result_w = os.pipe()
    asked = time.time()
    proc = request(str(socket_path), ["-m", "seen_module", "3"], {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
                   str(workdir), fds={0: 0, 1: 1, 2: 2, 3: result_w}, preload=preload)
    os.close(result_w)
    assert proc is not None
    with os.fdopen(result_r) as results:
        seen = json.loads(results.read())
    assert proc.wait() == 0
    return seen, seen["at"] - asked


def _slow_modules(tmp_path: Path, count: int, slow_s: float) -> tuple[Path, Path, dict[str, str]]:
    mods = tmp_path / "mods"
    mods.mkdir()
    for k in range(count):
        (mods / f"slow_{k}.py").write_text(SLOW_MODULE.format(slow_s=slow_s))
    (mods / "seen_module.py").write_text(SEEN_MODULE)
    log = tmp_path / "imports.log"
    env = {**os.environ, "IMPORT_LOG": str(log), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(mods), os.environ.get("PYTHONPATH", "")) if p)}
    return mods, log, env


def test_the_server_forks_while_it_imports_in_the_background_one_module_at_a_time(tmp_path) -> None:
    """--idle-preload: accepted before those imports, each done between select() rounds, so
    a request waits for one module's import at most; a later fork gets them all."""
    slow_s = 1.0
    mods, log, env = _slow_modules(tmp_path, 4, slow_s)
    socket_path = tmp_path / "sock"
    server = subprocess.Popen([sys.executable, "-m", "packrat.forkserver.server", "--socket", str(socket_path),
                               "--parent", str(os.getpid()), "--preload", "json",
                               "--idle-preload", "slow_0,slow_1,slow_2,slow_3"], env=env, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: log.exists(), 120, "the first background import")  # slow_0 has begun
        seen, waited = _ask(socket_path, mods)
        assert seen["ppid"] == server.pid
        # Forked before the background imports were done, after the one under way (slow_0
        # had begun when it asked) and no other...
        assert seen["slow"] == ["slow_0"], seen
        assert waited < slow_s + 1.5, waited  # ...having waited for one of them at most (4 take 4 s)
        # Each import ran by itself, one after the other, in the order given.
        wait_until(lambda: len(log.read_text().splitlines()) == 8, 120, "the background imports")
        events = [line.split() for line in log.read_text().splitlines()]
        assert [(e[0], e[1]) for e in events] == [(f"slow_{k}", w) for k in range(4) for w in ("start", "end")]
        later, _ = _ask(socket_path, mods)
        assert later["slow"] == ["slow_0", "slow_1", "slow_2", "slow_3"]
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()


def test_a_request_names_what_the_server_imports_before_forking_it(tmp_path) -> None:
    """The profiler's server (client.spawn's `preload`): imported before the fork, once, and
    nothing in the background."""
    mods, log, env = _slow_modules(tmp_path, 2, 0.2)
    socket_path = tmp_path / "sock"
    server = subprocess.Popen([sys.executable, "-m", "packrat.forkserver.server", "--socket", str(socket_path),
                               "--parent", str(os.getpid()), "--preload", ""], env=env, stderr=subprocess.PIPE)
    try:
        wait_until(socket_path.exists, 120, "the fork server's socket")
        first, _ = _ask(socket_path, mods, preload=("slow_0",))
        again, _ = _ask(socket_path, mods, preload=("slow_0",))
        assert first["slow"] == again["slow"] == ["slow_0"]  # slow_1: never asked for, never imported
        assert [line.split()[:2] for line in log.read_text().splitlines()] == [["slow_0", "start"], ["slow_0", "end"]]
        assert _ask(socket_path, mods, preload=("slow_1",))[0]["slow"] == ["slow_0", "slow_1"]
        # A name that is no module is refused like any malformed request: the caller starts Python.
        from packrat.forkserver.client import request

        assert request(str(socket_path), ["-m", "seen_module", "3"], os.environ, str(mods),
                       fds={0: 0, 1: 1, 2: 2}, preload=("os; rm -rf",)) is None
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()


def test_model_preload_names_what_the_archives_worker_imports(tmp_path) -> None:
    from packrat.profile.runner import model_preload

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert model_preload({"packrat": {"task": "noop"}}, str(tmp_path)) == ()
    assert model_preload({}, str(tmp_path)) == ()
    generation = model_preload({"packrat": {"task": "text-generation", "runtime": "eager"}}, str(tmp_path))
    assert "transformers.models.gpt2.modeling_gpt2" in generation and "tokenizers" in generation
    # A graph runtime loads its graph from the build cache: no transformers (its first worker
    # builds the graph and imports transformers itself).
    image = model_preload({"packrat": {"task": "image-classification", "runtime": "openvino"}}, str(tmp_path))
    assert image == ("PIL.Image",)
    from importlib.util import find_spec

    for name in (*generation, *image):  # every one of them is a module this environment has
        assert find_spec(name) is not None, name


def _fork_dir_of(server_pid: int) -> Path:
    argv = Path(f"/proc/{server_pid}/cmdline").read_bytes().decode().split("\0")
    return Path(argv[argv.index("--socket") + 1]).parent


# A process that owns a profiler-style fork server (client.spawn) with a worker running, and
# says where its socket is; then it waits to be killed.
OWNER = """\
import json, os, sys, time
from packrat.forkserver import client
proc = client.spawn([sys.argv[1], "sleep"], os.environ, fds={0: 0, 1: 2, 2: 2}, preload=("json",))
assert proc is not None
print(json.dumps({"socket": client._OWN.socket_path(), "worker": proc.pid}), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("whom", ["group", "owner"])
def test_a_sigtermed_owner_leaves_no_fork_server_directory(tmp_path, whom: str) -> None:
    """SIGTERM to the process group (RunningServer.stop's way, a test killing a controller) or
    to the owner alone: the server goes, its worker with it, and so does its directory."""
    (tmp_path / "worker.py").write_text(WORKER)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "worker.py")], stdout=subprocess.PIPE,
                             start_new_session=True, text=True)
    try:
        started = json.loads(owner.stdout.readline())
        directory = Path(started["socket"]).parent
        assert directory.name.startswith("packrat-fork-") and (directory / "sock").exists()
        server = _parent_of(started["worker"])
        assert _fork_dir_of(server) == directory
        if whom == "group":
            os.killpg(owner.pid, signal.SIGTERM)
        else:
            owner.terminate()
        assert owner.wait(timeout=30) == -signal.SIGTERM  # no atexit ran in the owner
        for pid in (server, started["worker"]):
            assert _wait_gone(pid), pid
        wait_until(lambda: not directory.exists(), 30, f"{directory} removed")
    finally:
        _kill_groups_of(str(tmp_path / "worker.py"))


def _favour(levels: int, *wrapper: str) -> tuple[str, int]:
    """favour_frontend(levels) in a fresh process (so this one keeps its nice): message, nice after.
    RLIMIT_NICE 0 there: only CAP_SYS_NICE (root's, unless `wrapper` drops it) may lower a nice."""
    code = ("import os, resource; from packrat.forkserver.launch import favour_frontend; "
            "resource.setrlimit(resource.RLIMIT_NICE, (0, 0)); "
            f"print(favour_frontend({levels})); print(os.getpriority(os.PRIO_PROCESS, 0))")
    done = subprocess.run([*wrapper, sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    message, nice = done.stdout.strip().splitlines()
    return message, int(nice)


def test_favour_frontend_lowers_the_nice_where_it_may_and_says_so_where_it_may_not() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    message, nice = _favour(0)
    assert nice == base and "PACKRAT_FRONTEND_NICE=0" in message
    if os.geteuid() == 0:
        message, nice = _favour(3)
        assert nice == max(-20, base - 3)
        assert message == f"TorchServe's frontend at nice {nice}, its workers at {base}"
        if shutil.which("setpriv"):  # util-linux; without it, this half is not tried
            # Without the privilege (root without CAP_SYS_NICE) it stays, and says why.
            message, nice = _favour(3, "setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice")
            assert nice == base and "needs root or CAP_SYS_NICE" in message
    with pytest.raises(ValueError, match="between 0 and 20"):
        from packrat.forkserver.launch import favour_frontend

        favour_frontend(21)


@pytest.fixture
def resnet_restored(torchserve):
    """The session server's tiny-resnet, registered for the test and put back as it was
    after it (the test unregisters it; other modules may have it registered)."""
    client = torchserve.management_client()
    had = "tiny-resnet" in {m["modelName"] for m in client.list_models()}
    ensure_registered(torchserve, "tiny-resnet")
    try:
        yield torchserve
    finally:
        now = "tiny-resnet" in {m["modelName"] for m in client.list_models()}
        if had and not now:
            ensure_registered(torchserve, "tiny-resnet")
        elif now and not had:
            for d in client.describe_all("tiny-resnet"):
                client.unregister("tiny-resnet", d["modelVersion"])


@pytest.mark.torchserve
def test_torchserve_workers_are_forked_and_scaled_down_with_their_shims(resnet_restored) -> None:
    torchserve = resnet_restored
    client = torchserve.management_client()
    described = client.describe("tiny-resnet")
    (worker,) = described["workers"]
    fork_server = _parent_of(worker["pid"])
    assert b"packrat.forkserver.server" in Path(f"/proc/{fork_server}/cmdline").read_bytes()
    assert _parent_of(fork_server) == torchserve.pid  # same process group: stop() stops it
    # One thread: a fork copies only the forking thread, so no other may hold a lock then
    # (numpy's OpenBLAS server thread would; the fork server starts it with one thread).
    assert len(os.listdir(f"/proc/{fork_server}/task")) == 1
    # The frontend runs favoured where the launcher may lower its nice (root here, in CI):
    # every JVM thread 10 levels (PACKRAT_FRONTEND_NICE's default) above the worker.
    java = next(iter(jvms(torchserve)))
    jvm_nices = {_nice_of(java, tid) for tid in os.listdir(f"/proc/{java}/task")}
    worker_nice = os.getpriority(os.PRIO_PROCESS, worker["pid"])
    assert worker_nice == os.getpriority(os.PRIO_PROCESS, 0)
    if os.geteuid() == 0:
        assert jvm_nices == {max(-20, worker_nice - 10)}, jvm_nices
    picture = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 90)).save(picture, format="JPEG")
    r = requests.post(f"{torchserve.inference_url}/predictions/tiny-resnet", data=picture.getvalue(),
                      headers=torchserve.inference_headers(), timeout=60)
    assert r.status_code == 200, r.text

    client.unregister("tiny-resnet", described["modelVersion"])
    assert _wait_gone(worker["pid"], timeout_s=60)
    assert process_alive(fork_server)


@pytest.mark.torchserve
def test_the_fork_server_serves_after_the_base_imports_and_a_stopped_server_leaves_no_directory(tiny_store, tmp_path) -> None:
    """The fork server takes requests once every worker's imports are in (BASE_PRELOAD) and
    imports the models' libraries while idle; stop() (SIGTERM to the group) leaves no
    directory of it behind."""
    from packrat.forkserver.server import BASE_PRELOAD, MODEL_PRELOAD

    server = start_server(tiny_store, tmp_path / "ts")
    try:
        (worker,) = server.register("noop")
        fork_server = _parent_of(worker["pid"])
        assert b"packrat.forkserver.server" in Path(f"/proc/{fork_server}/cmdline").read_bytes()
        directory = _fork_dir_of(fork_server)
        out = server.workdir / "torchserve.out"
        ready = f"packrat fork server: ready, preloaded {len(BASE_PRELOAD)} modules"
        idle = f"packrat fork server: imported {len(MODEL_PRELOAD)} more modules while idle"
        wait_until(lambda: idle in out.read_text(errors="replace"), 180, "the fork server's idle imports")
        text = out.read_text(errors="replace")
        assert ready in text and text.index(ready) < text.index(idle)
        assert "not preloaded" not in text  # every one of them is here to import
        assert len(os.listdir(f"/proc/{fork_server}/task")) == 1  # still one thread to fork from
        r = requests.post(f"{server.inference_url}/predictions/noop", data=b"ping",
                          headers=server.inference_headers(), timeout=60)
        assert r.status_code == 200 and r.content == b"ping"
        assert directory.exists()
    finally:
        server.stop()
    assert not directory.exists()
    for pid in (worker["pid"], fork_server):
        assert _wait_gone(pid), pid


@pytest.mark.torchserve
def test_PACKRAT_FORKSERVER_0_starts_workers_the_way_torchserve_does(tiny_store, tmp_path) -> None:
    server = start_server(tiny_store, tmp_path / "ts", env={**os.environ, "PACKRAT_FORKSERVER": "0"})
    try:
        (worker,) = server.register("noop")
        java = _parent_of(worker["pid"])
        assert b"org.pytorch.serve.ModelServer" in Path(f"/proc/{java}/cmdline").read_bytes()
    finally:
        stop_in_background(server)


@pytest.mark.torchserve
def test_packrat_torchserve_returns_like_torchserve_start_and_stop_stops_it_all(tiny_store, tmp_path) -> None:
    # The drop-in for `torchserve` (packrat-torchserve): backgrounds itself, forks workers
    # warm, and `torchserve --stop` takes the frontend, fork server and workers down.
    ports = Ports.free()
    config = tmp_path / "config.properties"
    config.write_text(render_properties(DEFAULT_CONFIG, ports, tiny_store, None))
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "TEMP": str(tmp_path / "tmp"),
           "PACKRAT_SLOT_DIR": str(tmp_path / "slots")}
    env.pop("TS_CONFIG_FILE", None)
    command = [sys.executable, "-m", "packrat.forkserver.launch"]
    started = subprocess.run([*command, "--start", "--ncs", "--ts-config", str(config), "--model-store",
                              str(tiny_store)], cwd=tmp_path, env=env, timeout=60,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert started.returncode == 0
    server = RunningServer(workdir=tmp_path, model_store=tiny_store, pid=0, ports=ports, config_path=config)
    try:
        deadline = time.monotonic() + 180
        while not _healthy(server):
            assert time.monotonic() < deadline, "TorchServe did not start"
            time.sleep(0.5)
        (worker,) = server.register("noop", timeout_s=180)
        fork_server = _parent_of(worker["pid"])
        assert b"packrat.forkserver.server" in Path(f"/proc/{fork_server}/cmdline").read_bytes()
        launcher = _parent_of(fork_server)
        stopped = subprocess.run([*command, "--stop"], cwd=tmp_path, env=env, timeout=120,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert stopped.returncode == 0
        for pid in (worker["pid"], fork_server, launcher):
            assert _wait_gone(pid, timeout_s=60), pid
    finally:  # whatever is left (the launcher leads its own session): its whole group
        _kill_groups_of(str(config))


def _noop_answers(server: RunningServer) -> bool:
    try:  # the keys are read again each time: a new JVM writes new ones
        r = requests.post(f"{server.inference_url}/predictions/noop", data=b"ping",
                          headers=server.inference_headers(), timeout=10)
    except (requests.RequestException, OSError, ValueError):
        return False
    return r.status_code == 200


@pytest.mark.torchserve
def test_a_crashed_frontend_is_started_again_with_its_models_and_a_stopped_one_is_not(tiny_store, tmp_path) -> None:
    """The JVM killed with SIGKILL (an OOM kill): packrat-torchserve starts TorchServe again with
    the same arguments, so the model in --models serves again (with fresh keys), and the old
    JVM's worker is gone. SIGTERM to the JVM (what `torchserve --stop` sends) ends it for good."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "noop").symlink_to(tiny_store / "noop", target_is_directory=True)
    server = start_server(store, tmp_path / "ts", models=["noop"])
    try:
        wait_until(lambda: _noop_answers(server), 120, "noop to answer")
        (jvm,) = jvms(server)
        (old_worker,) = [w["pid"] for w in server.management_client().describe("noop")["workers"]]
        os.kill(jvm, signal.SIGKILL)
        wait_until(lambda: jvms(server) - {jvm}, 60, "another JVM")
        wait_until(lambda: _noop_answers(server), 120, "noop to answer from the new JVM")
        (new_jvm,) = jvms(server)
        (new_worker,) = [w["pid"] for w in server.management_client().describe("noop")["workers"]]
        assert new_worker != old_worker
        wait_until(lambda: not process_alive(old_worker), 30, "the old JVM's worker to end")
        out = (server.workdir / "torchserve.out").read_text(errors="replace")
        assert f"TorchServe's frontend (pid {jvm}) was killed by SIGKILL" in out, out[-3000:]

        os.kill(new_jvm, signal.SIGTERM)  # stopped on purpose: not started again
        wait_until(lambda: not server.is_running(), 60, "packrat-torchserve to end with its JVM")
        out = (server.workdir / "torchserve.out").read_text(errors="replace")
        assert jvms(server) == set() and out.count("packrat: TorchServe's frontend (pid") == 1, out[-3000:]
    finally:
        server.stop()
