"""TorchServe entry point of every Packrat archive (copied into the archive as-is).

TorchServe imports this module from the archive directory and calls
`handle(None, context)` once to initialise, then `handle(batch, context)` per
batch. Importing it does nothing else: no torch import, no global settings.

Profiler interface (times exactly the path handle() takes, outside TorchServe):

    import packrat_handler                        # archive dir on sys.path
    task = packrat_handler.load_task(model_dir, model_yaml_config)
    requests = task.sample_requests(n)            # [{"body": bytes}, ...]
    responses = task.run(requests)                # == postprocess(forward(preprocess(requests)))

See docs/handler.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packrat_tasks.base import Task
    from ts.context import Context

_task: Task | None = None  # the loaded Task of this worker process


def load_task(model_dir: str, model_yaml_config: dict[str, Any]) -> Task:
    """Load the archive's model and return its Task (no thread pinning here)."""
    from packrat_tasks import build_task

    return build_task(model_dir, model_yaml_config or {})


def initialize(context: Context) -> None:
    global _task
    # TorchServe 0.12's worker json.loads()es application/json bodies (and
    # decodes text/*) before the handler runs, with no size or depth bound; it
    # reads this variable per request, so from now on this worker hands every
    # body over as bytes and packrat_tasks bounds it before decoding.
    os.environ["TS_DECODE_INPUT_REQUEST"] = "false"
    # First: claim this worker's slot and pin it, before torch starts thread pools
    # and before the model's memory is touched. None when the version has no plan.
    import time

    from packrat.slots import claim_and_pin, lowered_priority, report_startup
    from packrat.tslog import quiet_worker_request_lines, thin_prediction_metric

    quiet_worker_request_lines()  # one stdout line per request less for worker and frontend
    thin_prediction_metric(getattr(context, "metrics", None))  # and the metric line a batch: one a second
    claim_and_pin(context.model_yaml_config)
    t0 = time.perf_counter()
    with lowered_priority():  # PACKRAT_LOAD_NICE: yield to the serving version while loading
        try:
            _task = load_task(context.system_properties["model_dir"], context.model_yaml_config)
        except Exception as exc:
            # For the swap waiting on this worker: TorchServe only restarts it, and a refused
            # mode (the guard's verdict is cached) would be refused at every restart.
            report_startup(load_error=f"{type(exc).__name__}: {exc}"[:2000])
            raise
    # Where this worker's start-up went, for the swap record (docs/live-plans.md):
    # the runner times building its mode, the guard and the warm-up; the rest is model load.
    runner = getattr(_task, "runner", None)
    phases = dict(getattr(runner, "phases_s", None) or {})
    phases["model_load"] = round(max(0.0, time.perf_counter() - t0 - sum(phases.values())), 3)
    report_startup(loaded_at=time.time(), phases=phases,
                   cache=(getattr(runner, "info", None) or {}).get("build_cache", {}))


def handle(data: list[dict] | None, context: Context) -> list[Any] | None:
    if data is None:  # TorchServe's initialisation call for function entry points
        if _task is None:
            initialize(context)
        return None
    if _task is None:
        initialize(context)
    return _task.handle(data, context)
