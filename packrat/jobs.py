"""Background jobs the controller runs for the REST API (today: profiling).

A job runs in a daemon thread; its state moves queued -> running -> done | failed
and its result (or the error, with a short traceback) stays readable by id
until the controller exits. One job of a kind at a time: two profiling runs
on the same cores would measure each other.
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packrat.errors import BusyError


# Mutable: only the job's own thread changes state, result, error and finished.
@dataclass
class Job:
    """A background job: poll it until `state` is done (see `result`) or failed (see `error`)."""

    id: str
    kind: str
    model: str
    state: str  # queued | running | done | failed
    created: float
    finished: float | None = None
    result: dict[str, Any] | None = None
    error: str | None = None


class Jobs:
    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def start(self, kind: str, model: str, work: Callable[[], dict[str, Any]]) -> Job:
        """Run `work` in the background; BusyError while a job of this kind is unfinished."""
        job = Job(id=uuid.uuid4().hex[:12], kind=kind, model=model, state="queued", created=time.time())
        with self._lock:
            if any(j.kind == kind and j.state in ("queued", "running") for j in self._jobs.values()):
                raise BusyError(f"a {kind} job is already running")
            self._jobs[job.id] = job

        def run() -> None:
            job.state = "running"
            try:
                job.result = work()
                job.state = "done"
            except Exception as exc:  # reported through the job, not swallowed
                job.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
                job.state = "failed"
            finally:
                job.finished = time.time()

        threading.Thread(target=run, name=f"{kind}-{job.id}", daemon=True).start()
        return job
