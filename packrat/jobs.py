"""Background jobs the controller runs for the REST API (profiling, tuning).

A job runs in a daemon thread; its state moves queued -> running -> done | failed
and its result (or the error, with a short traceback) stays readable by id
for FINISHED_TTL_S after it finished, among the last KEEP_FINISHED of its kind
(older finished jobs are forgotten when the next one starts or jobs are listed:
a controller that runs for months does not keep every job); a running job may
publish `progress`. One job of
a kind at a time (or, with per_model, one per model). Jobs given the same
`Turns` run one after another in the order they were started, waiting as
"queued": two profiling runs on the same cores would measure each other.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from packrat.errors import BusyError

KEEP_FINISHED = 20  # finished jobs kept per kind, the newest
FINISHED_TTL_S = 24 * 3600.0  # and none longer than this after it finished


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
    progress: dict[str, Any] | None = None  # what a running job is doing (e.g. a tune's stage)


class Turns:
    """First come, first served: one holder at a time, in the order tickets were taken.

    A ticket is taken where the order is decided (`take`, in the submitting thread) and
    held later (`hold`, in whatever thread does the work): taking it inside a new thread
    would order jobs by when their threads got scheduled, not by when they were started.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._serving = 0
        self._dropped: set[int] = set()

    def take(self) -> int:
        """The next ticket: pass it to `hold` (or to `drop`, if it will never be held)."""
        with self._cond:
            ticket = self._next
            self._next += 1
            return ticket

    @contextlib.contextmanager
    def hold(self, ticket: int) -> Iterator[None]:
        """Wait until every earlier ticket was held and released (or dropped), then hold this one."""
        with self._cond:
            while self._serving != ticket:
                self._cond.wait()
        try:
            yield
        finally:
            self._advance()

    def drop(self, ticket: int) -> None:
        """Give up a ticket that will never be held, so the ones after it still get their turn."""
        with self._cond:
            self._dropped.add(ticket)
            self._skip_dropped()

    def _advance(self) -> None:
        with self._cond:
            self._serving += 1
            self._skip_dropped()

    def _skip_dropped(self) -> None:  # with self._cond held
        while self._serving in self._dropped:
            self._dropped.remove(self._serving)
            self._serving += 1
        self._cond.notify_all()


class Jobs:
    def __init__(self, keep: int = KEEP_FINISHED, ttl_s: float = FINISHED_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self.keep, self.ttl_s, self.clock = keep, ttl_s, clock

    def _forget_old(self) -> None:  # with self._lock held
        """Drop finished jobs past the TTL, and beyond the newest `keep` finished of each kind."""
        now = self.clock()
        finished: dict[str, list[Job]] = {}
        for j in self._jobs.values():
            if j.finished is not None and j.state in ("done", "failed"):
                finished.setdefault(j.kind, []).append(j)
        for jobs in finished.values():
            jobs.sort(key=lambda j: j.finished or 0.0, reverse=True)
            for i, j in enumerate(jobs):
                if i >= self.keep or now - (j.finished or now) > self.ttl_s:
                    del self._jobs[j.id]

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def recent(self, model: str | None = None, last: int = 20) -> list[Job]:
        """The latest `last` jobs (of `model`, if given), oldest first."""
        with self._lock:
            self._forget_old()
            jobs = [j for j in self._jobs.values() if model in (None, j.model)]
        return sorted(jobs, key=lambda j: j.created)[-last:]

    def unfinished(self, kind: str, model: str | None = None) -> Job | None:
        """The queued or running job of `kind` (for `model`, if given), if any."""
        with self._lock:
            for j in self._jobs.values():
                if j.kind == kind and j.state in ("queued", "running") and model in (None, j.model):
                    return j
        return None

    def start(self, kind: str, model: str, work: Callable[..., dict[str, Any]], *,
              per_model: bool = False, turns: Turns | None = None, with_job: bool = False) -> Job:
        """Run `work` in the background; BusyError while a job of this kind (per_model: of
        this kind for this model) is unfinished. `turns`: wait for its turn first (state
        queued). `with_job`: call work(job), so it can publish job.progress."""
        job = Job(id=uuid.uuid4().hex[:12], kind=kind, model=model, state="queued", created=self.clock())
        with self._lock:
            if any(j.kind == kind and j.state in ("queued", "running") and (not per_model or j.model == model)
                   for j in self._jobs.values()):
                raise BusyError(f"a {kind} job{f' for {model}' if per_model else ''} is already running")
            self._forget_old()
            self._jobs[job.id] = job
            # The ticket now, in the caller's thread and under the lock: jobs started
            # a, b, c hold their turns a, b, c however their threads get scheduled.
            ticket = turns.take() if turns is not None else None

        def run() -> None:
            with turns.hold(ticket) if turns is not None and ticket is not None else contextlib.nullcontext():
                job.state = "running"
                try:
                    job.result = work(job) if with_job else work()
                    job.state = "done"
                except Exception as exc:  # reported through the job, not swallowed
                    job.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
                    job.state = "failed"
                finally:
                    job.finished = self.clock()

        try:
            threading.Thread(target=run, name=f"{kind}-{job.id}", daemon=True).start()
        except BaseException:  # no thread, no turn to wait for: the jobs queued behind it go on
            if turns is not None and ticket is not None:
                turns.drop(ticket)
            job.state, job.error, job.finished = "failed", "could not start its thread", self.clock()
            raise
        return job
