"""The efficiency benchmark's peer level (issue 35 item 1): the same archive served by one lean
peer server, LitServe (the bench-only `peer` extra), so "ahead of every peer" is measured.

PeerServer starts packrat.bench.peer_server in a process group of its own on a free
loopback port, waits until every worker has loaded the model and every HTTP server
process is up, and names each of its processes for the CPU table. Between its
measured windows the benchmark pauses the group (SIGSTOP): LitServe's idle batching
workers poll their queue every millisecond, CPU that must not land in the other
levels' windows.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from packrat.bench.loadgen import LoadResult, Target, window_closed_loop
from packrat.bench.proc_cpu import command_name, group_members
from packrat.errors import ConfigError
from packrat.server import free_ports

PEER = "LitServe"
BATCH_TIMEOUT_S = 0.005  # LitServe's batch fill wait, as a lean user sets it (issue 35's LitServe run)


def peer_missing() -> str | None:
    """Why the peer level cannot run here; None when it can."""
    if importlib.util.find_spec("litserve") is None:
        return "litserve is not installed (the bench-only extra: pip install -e '.[peer]')"
    return None


class PeerServer:
    """LitServe serving `archive_dir` with one pinned worker per (threads, cap) of `shape`."""

    def __init__(self, archive_dir: Path, config: dict[str, Any], shape: list[tuple[int, int]],
                 blocks: list[list[int]], body: bytes, ctype: str, workdir: Path,
                 ready_timeout_s: float = 900.0) -> None:
        from packrat.profile.worker import profile_config

        self.workers = len(shape)
        self.notes = workdir / "notes"
        self.notes.mkdir(parents=True, exist_ok=True)
        for old in self.notes.iterdir():  # a previous run's notes would name dead processes
            old.unlink()
        self.port = free_ports(1)[0]
        job = {"archive_dir": str(archive_dir), "config": profile_config(config), "shape": shape,
               "blocks": blocks, "port": self.port, "batch_timeout_s": BATCH_TIMEOUT_S,
               "timeout_s": 300.0, "notes_dir": str(self.notes)}
        (workdir / "job.json").write_text(json.dumps(job, indent=1))
        # The served level's body and content type, base64 in JSON (peer_server says why).
        self.body = json.dumps({"body_b64": base64.b64encode(body).decode(), "content_type": ctype}).encode()
        self.log_path = workdir / "peer.log"
        # Its temporary files in its own directory: the multiprocessing Manager's socket
        # directory (pymp-*) outlives the peer's group when stop() kills it.
        self.tmp = workdir / "tmp"
        self.tmp.mkdir(exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "packrat.bench.peer_server", str(workdir / "job.json")],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "TMPDIR": str(self.tmp)})
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _noted(self, role: str) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.notes.glob(f"{role}-*.json"))]

    def _wait_ready(self, timeout_s: float) -> None:
        """Every worker loaded, every HTTP server started (one per worker: LitServe's default)
        and /health answering 200 (LitServe's: all workers ready)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(f"{PEER} exited with {self.proc.returncode} while starting: {self._log_tail()}")
            if len(self._noted("worker")) == self.workers and len(self._noted("http")) == self.workers:
                try:
                    with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                        if resp.status == 200:
                            return
                except (urllib.error.URLError, OSError):
                    pass  # not listening yet, or 503 while a worker is still loading
            time.sleep(0.2)
        raise ConfigError(f"{PEER} not ready within {timeout_s:.0f} s: {self._log_tail()}")

    def _log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def target(self) -> Target:
        return Target(f"{self.url}/predict", self.body, "application/json", timeout_s=300.0)

    def load(self, seconds: float, clients: int, client: str = "lean") -> LoadResult:
        return window_closed_loop(self.target(), clients, seconds, client)

    def workers_seen(self) -> list[dict[str, Any]]:
        """Each worker's note: pid, cores, threads and the pinning it observed after loading."""
        return sorted(self._noted("worker"), key=lambda n: n["worker"])

    def processes(self) -> dict[int, str]:
        """pid -> label for every process of the peer's group, and this client."""
        labels: dict[int, str] = {}
        for n in self.workers_seen():
            labels[n["pid"]] = f"peer worker {n['worker'] + 1} (cores {','.join(map(str, n['cores']))})"
        for k, n in enumerate(self._noted("http"), 1):
            labels[n["pid"]] = f"peer HTTP server {k} (uvicorn)"
        labels[self.proc.pid] = f"peer main process ({PEER} launcher and worker monitor)"
        for pid in group_members(self.proc.pid):
            if pid not in labels:
                # Forked from the launcher (same command line): the multiprocessing Manager,
                # whose queue carries every request from the HTTP servers to the workers.
                same = command_name(pid) == command_name(self.proc.pid)
                label = "peer request queue (multiprocessing Manager)" if same else f"peer other: {command_name(pid)}"
                while label in labels.values():
                    label += "'"
                labels[pid] = label
        labels[os.getpid()] = "client (the load generator, this process)"
        return labels

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 15.0) -> None:
        """The whole group: continued, terminated, killed after `grace_s`; idempotent."""
        self.resume()
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.proc.poll()  # reap the launcher so it stops counting as alive
            if not group_members(self.proc.pid):
                break
            time.sleep(0.2)
        else:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)
