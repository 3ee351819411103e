"""TorchServe workers forked from a warm interpreter instead of started cold.

TorchServe 0.12 starts every Python worker as `<python> ts/model_service_worker.py ...`
and an eager worker then spends most of its start importing torch and transformers
(3.3-3.8 s of CPU on the 2-core EPYC, docs/live-plans.md), which is most of a live swap.
`packrat.server` starts TorchServe with two helpers beside it:

- server.py, the fork server: one process that imports those libraries once
  (what every worker needs first, BASE_PRELOAD; what only some models need,
  MODEL_PRELOAD, afterwards while idle), then forks a child per worker start,
  which runs the worker script in the caller's argv, environment, working
  directory and stdio;
- shim.py, written as an executable file (write_shim) that TorchServe uses as its
  `python`: it hands its request to the fork server, relays signals and exits with
  the child's status; without a fork server, or for a request the fork server must
  not serve (startup-only environment such as LD_PRELOAD differs), it execs the real
  interpreter, i.e. what TorchServe does by itself.

The worker keeps TorchServe's view of a process: its pid (the `[PID]` line, /proc),
its pipes, its exit. When TorchServe kills the shim (scale-down, restart) the fork
server kills the child; when the fork server dies (killed) its workers serve on, each
followed by its shim through a pidfd, and launch.py starts another fork server (a shim
that finds none starts Python itself). The profiler's children die with it
(PR_SET_PDEATHSIG).
The profiler forks its workers the same way from a fork server of its own
(client.py: `-m module` requests with extra descriptors, started on first use;
each request names what its child imports, which the server imports before the fork).
PACKRAT_FORKSERVER=0 turns both off.
"""

from __future__ import annotations

from pathlib import Path

from packrat import settings

SHIM_SOURCE = Path(__file__).with_name("shim.py")
# True in a process the fork server forked (server.become_worker sets it).
FORKED = False
# Longest `#!interpreter flags` line the kernel reads whole (BINPRM_BUF_SIZE, Linux >= 5.1).
_SHEBANG_MAX = 255


def enabled(environ: dict[str, str] | None = None) -> bool:
    return settings.value("forkserver", env=environ)  # $PACKRAT_FORKSERVER, on unless 0/false/no/off


def write_shim(path: Path, real_python: str, socket_path: str, worker_nice: int | None = None) -> bool:
    """Write TorchServe's `python` for workers at `path`; False if the kernel could not run it.

    `-S -E`: the shim needs only the standard library, so it skips site and the
    environment (TorchServe's PYTHONPATH) to start in tens of milliseconds.
    `worker_nice`: the nice a worker the shim starts itself (the fork server's fallback)
    goes back to, where the frontend runs favoured (launch.favour_frontend): the worker
    would otherwise inherit the frontend's.
    """
    shebang = f"#!{real_python} -SE"
    if " " in real_python or len(shebang) > _SHEBANG_MAX:
        return False
    source = SHIM_SOURCE.read_text()
    path.write_text(f"{shebang}\n{source}\n\nmain({real_python!r}, {socket_path!r}, {worker_nice!r})\n")
    path.chmod(0o700)
    return True
