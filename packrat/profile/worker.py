"""One isolated profiling process: one thread count t, every batch size.

    python -m packrat.profile.worker JOB.json RESULT_FD

The runner starts one of these per thread count, forked by its fork server
(packrat.forkserver.client: torch and transformers already imported, no thread
pool started yet, as in a served worker forked beside TorchServe) or, without
one, as a new interpreter. It pins itself with the served worker's recipe
(packrat.slots: affinity and thread-count variables before any pool starts, then
torch's intra-op and inter-op pools), so every thread pool (OpenMP, oneDNN,
OpenBLAS, tokenizers) is born on the right cores with the right size, and the
profile measures the settings a served worker on that slot runs with. It then
loads the model once through the archive's own handler (`packrat_handler`)
and times each batch size in turn: one process per t, not per (t, b), because
loading BERT or ResNet-50 costs seconds and the batch size does not change
the process's pinning or pools. Its budget counts from when the runner asked
for it, start-up included.

It reports JSON lines on RESULT_FD (a pipe from the runner; stdout/stderr stay
free for whatever the handler prints):
    {"event": "ready", ...}                        model loaded, pinning observed
    {"event": "start", "batch": b}                 a point begins
    {"event": "point", "threads", "batch", stats..., "meta": {...}}
    {"event": "omitted", "threads", "batch", "reason"}
    {"event": "error", "message"}                  then exit status 1
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from packrat import forkserver, slots  # import no numeric library: safe before pinning


def profile_config(config: dict[str, Any]) -> dict[str, Any]:
    """The archive's config minus Packrat slots, so the handler does not claim and re-pin."""
    cfg = dict(config)
    packrat_cfg = cfg.get("packrat")
    if isinstance(packrat_cfg, dict):
        cfg["packrat"] = {k: v for k, v in packrat_cfg.items() if k not in ("slots", "plan_id")}
    return cfg


class _Reporter:
    def __init__(self, fd: int) -> None:
        self._f = os.fdopen(fd, "w", buffering=1)

    def __call__(self, event: str, **fields: Any) -> None:
        self._f.write(json.dumps({"event": event, **fields}) + "\n")
        self._f.flush()


def run_job(job: dict[str, Any], report: _Reporter) -> None:
    started = time.perf_counter()
    threads = int(job["threads"])
    torch_version = _pin(job["cores"], threads)

    from packrat.profile.stats import StopRule  # numpy/scipy: after pinning too

    rule = StopRule(**job["rule"])
    issued = float(job.get("issued_monotonic", time.monotonic()))  # when the runner asked for us
    deadline = None
    if job.get("budget_s") is not None:  # counted from then: a fork or a start-up is spent budget
        deadline = started + float(job["budget_s"]) - max(0.0, time.monotonic() - issued)
    task = _load_task(job, report, issued, torch_version)

    # A batch of the traffic is padded to its largest request: each batch at its own sizes.
    by_batch = {int(b): sizes for b, sizes in job.get("sizes_by_batch") or ()}
    last: tuple[int, float] | None = None  # (batch, mean_ms) of the previous point
    for batch in job["batches"]:
        now = time.perf_counter()
        if deadline is not None:
            # Warm-up plus one timed call must fit, judged from the previous point
            # scaled by batch size; otherwise say so instead of overrunning the budget.
            need_s = 0.0 if last is None else 2 * last[1] / 1000.0 * batch / last[0]
            if deadline - now <= need_s:
                report("omitted", threads=threads, batch=batch,
                       reason=f"total budget exhausted (needs ~{need_s:.1f} s, {max(0.0, deadline - now):.1f} s left)")
                continue
        report("start", batch=batch)
        point = _time_batch(task, batch, job["scope"], rule, deadline, threads,
                            by_batch.get(batch, job.get("sizes")))
        if point is None:
            report("omitted", threads=threads, batch=batch, reason="total budget exhausted during warm-up")
            continue
        last = (batch, point["mean_ms"])
        report("point", threads=threads, batch=batch, **point)


def _pin(cores: list[int], threads: int) -> str:
    """Pin this process the served worker's way, torch imported in between; torch's version."""
    slots.pin_threads(cores, threads)  # affinity + pool variables first

    import torch  # noqa: E402 - deliberately after pinning

    slots.set_torch_threads(threads)
    return torch.__version__


def _load_task(job: dict[str, Any], report: _Reporter, issued: float, torch_version: str) -> Any:
    """Load the model through the archive's own handler; report "ready"."""
    archive_dir = job["archive_dir"]
    sys.path.insert(0, archive_dir)
    import packrat_handler  # the archive's own handler module

    t_load = time.perf_counter()
    task = packrat_handler.load_task(archive_dir, profile_config(job["config"]))
    report(
        "ready",
        pid=os.getpid(),
        **slots.observed_settings(),
        torch_version=torch_version,
        forked=forkserver.FORKED,  # by the runner's fork server, or a new interpreter
        ready_s=round(time.monotonic() - issued, 3),  # asked for -> loaded: start-up + load
        load_s=round(time.perf_counter() - t_load, 3),
        # Execution mode: build (compile + warm-up) time, memory, accuracy-guard numbers.
        mode=getattr(getattr(task, "runner", None), "summary", lambda: None)(),
    )
    return task


def _sample_requests(task: Any, batch: int, sizes: dict[str, int] | None) -> tuple[list[dict], dict | None]:
    """`batch` requests at `sizes`, and the sizes they were made at (None: the task's sample)."""
    if sizes:
        try:
            return task.sample_requests(batch, sizes), sizes
        except TypeError:  # an archive built before request sizes: its task takes n alone
            pass
    return task.sample_requests(batch), None


def _served_once(task: Any, requests: list[dict], asked: dict[str, int] | None) -> dict[str, int] | None:
    """Serve `requests` once, untimed (the handler must answer each), and say the request
    size per kind they were timed at: a kind asked for as asked, every other kind as the
    served worker's size histogram counts it (the task's own Task.served_sizes, so the
    sample's sizes compare with the traffic's like for like; the requests are copies of
    one, so any row's size is theirs). None: none asked and the task cannot count them
    (an archive built before request sizes)."""
    counted: dict[str, list[int]] = {}
    if hasattr(task, "serve") and hasattr(task, "served_sizes"):
        served, responses = task.serve(requests)
        counted = task.served_sizes(served, responses) if served.valid else {}
    else:
        responses = task.run(requests)
    if len(responses) != len(requests):
        raise RuntimeError(f"handler returned {len(responses)} responses for a batch of {len(requests)}")
    timed = {kind: max(sizes) for kind, sizes in counted.items() if sizes}
    return {**timed, **(asked or {})} or None


def _time_batch(task: Any, batch: int, scope: str, rule: Any, deadline: float | None,
                threads: int, sizes: dict[str, int] | None = None) -> dict[str, Any] | None:
    """One point's statistics and meta ("point" event fields), None if the budget ran out in warm-up.
    `sizes`: the request size per kind to time (the traffic's, ProfileSettings.sizes); none:
    the task's own sample. The meta's "sizes" are those timed (_served_once)."""
    from packrat.profile.stats import measure

    requests, asked = _sample_requests(task, batch, sizes)
    sizes = _served_once(task, requests, asked)
    if scope == "model":
        inputs = task.preprocess(requests)

        def call() -> object:
            return task.forward(inputs)
    else:
        def call() -> object:
            return task.run(requests)

    # CPU time this process got per wall second per thread: well below 1 means the
    # instance was starved by other load (spin-waiting OpenMP threads count as busy,
    # so it is an upper bound). Load average says the same from the outside.
    # Run-queue wait of the calling thread (the one that computes at one thread) per wall
    # second: the time it was runnable but another task had its core. packrat.profile.contention
    # takes it out of a one-thread point's figures; None where the kernel does not say.
    # The same wait summed over all of the process's threads, per wall second per thread the
    # point asks for: a runtime's pool threads descheduled by other work wait there, while
    # threads idle by nature (GPT-2's Python loop between ops, a handler that sleeps) lower
    # cpu_share but wait for no core.
    # And whether the wait was others' doing: the CPU time the point's cores spent on other
    # processes (their busy ticks less this process's CPU time) per wall second per core. A
    # runtime that starts more threads than the slot's on its cores (OpenVINO at two threads)
    # waits on itself: its figures are what serving it costs, nothing to correct or re-measure.
    load_before = os.getloadavg()[0]
    wait0, all0, ticks0 = _runq_wait_s(), _runq_wait_all_s(), _core_ticks()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    stats = measure(call, rule, deadline=deadline)
    wall = max(1e-9, time.perf_counter() - wall0)
    cpu = time.process_time() - cpu0
    cpu_share = cpu / (wall * threads)
    wait1, all1, ticks1 = _runq_wait_s(), _runq_wait_all_s(), _core_ticks()
    runq_share = None if wait0 is None or wait1 is None else min(1.0, max(0.0, (wait1 - wait0) / wall))
    runq_all = None if all0 is None or all1 is None else min(1.0, max(0.0, (all1 - all0) / (wall * threads)))
    others = _others_share(ticks0, ticks1, cpu, wall)
    if stats is None:
        return None
    return {
        "mean_ms": stats.mean_ms,
        "p50_ms": stats.p50_ms,
        "p99_ms": stats.p99_ms,
        "std_ms": stats.std_ms,
        "count": stats.count,
        "meta": {
            **slots.observed_settings(),
            "converged": stats.converged,
            "ci_half_width_ms": stats.ci_half_width_ms,
            "warmup_calls": stats.warmup_calls,
            "elapsed_s": round(stats.elapsed_s, 3),
            "pid": os.getpid(),
            "sizes": sizes,  # the request sizes timed (None: the task's own sample, its size unknown)
            "cpu_share": round(cpu_share, 3),
            "runq_share": None if runq_share is None else round(runq_share, 3),
            "runq_share_all": None if runq_all is None else round(runq_all, 3),
            "others_share": None if others is None else round(others, 3),
            "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
    }


def _runq_wait_s() -> float | None:
    """Seconds the calling thread has waited on a run queue (schedstat's second field), None
    where /proc does not have it (a kernel without CONFIG_SCHED_INFO)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _runq_wait_all_s() -> float | None:
    """Seconds all of this process's threads have waited on a run queue (schedstat's second
    field summed over /proc/self/task; a thread gone between listing and reading is left
    out), None where /proc does not have it."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    total, seen = 0, False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9 if seen else None


def _core_ticks() -> dict[int, tuple[int, int]] | None:
    """/proc/stat's (idle, all) ticks of the CPUs this process may run on (its slot's cores),
    None where it cannot be read."""
    from packrat.cores import read_cpu_ticks

    try:
        mine = os.sched_getaffinity(0)
        return {c: t for c, t in read_cpu_ticks().items() if c in mine}
    except (OSError, ValueError, IndexError):
        return None


def _others_share(before: dict[int, tuple[int, int]] | None, after: dict[int, tuple[int, int]] | None,
                  own_cpu_s: float, wall_s: float) -> float | None:
    """CPU time other processes had on these cores per wall second per core (0..1): the
    cores' busy time between the readings less this process's own CPU time. None without
    readings."""
    if not before or not after:
        return None
    cores = [c for c in before if c in after]
    busy = sum((after[c][1] - after[c][0]) - (before[c][1] - before[c][0]) for c in cores)
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    others = busy / hz - own_cpu_s
    return min(1.0, max(0.0, others / (wall_s * len(cores)))) if cores else None


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m packrat.profile.worker JOB.json RESULT_FD", file=sys.stderr)
        return 2
    job_file = Path(argv[1])
    job = json.loads(job_file.read_text())
    # Read once, by this worker only: removed now, not only by the runner when the worker ends,
    # so a runner killed -9 meanwhile (no handler runs) leaves no job file in /tmp.
    job_file.unlink(missing_ok=True)
    report = _Reporter(int(argv[2]))
    try:
        run_job(job, report)
    except Exception as exc:  # reported to the runner, which turns it into a ProfileError
        import traceback

        traceback.print_exc()  # full detail goes to the worker log
        report("error", message=f"{exc.__class__.__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
