"""Which log configuration TorchServe's frontend starts with, and which per-request
lines its Python workers leave out (the request line; all but one PredictionTime metric
line a second).

TorchServe 0.12's built-in log4j2 configuration logs its own classes at debug and
writes each line up to three times (ts_log.log twice, the console once), about ten
lines per request. Packrat starts the frontend with `packrat/log4j2.xml` instead:
the same files, each line once, no per-request lines but the access log's: 41x fewer
log bytes per request and ~0.8 ms less JVM CPU per no-op request on a 2-core EPYC
(docs/live-plans.md, "Frontend logging").

A caller who chose a configuration keeps it: an explicit `--log-config`, a
`-Dlog4j.configurationFile` in the ts-config's `vmargs` (TorchServe's launcher would
drop that one in favour of `--log-config`), or the environment variable below.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packrat import settings
from packrat.worker_messages import REQUEST_LINE

LOG_CONFIG = Path(__file__).with_name("log4j2.xml")
# A path to another log4j2 file, or "torchserve" for TorchServe's built-in configuration
# (debug lines for every request: useful when following one through the frontend).
ENV = settings.get("ts_log_config").env
BUILT_IN = "torchserve"


def _asked(env: dict[str, str] | None) -> str:
    return settings.value("ts_log_config", env=env) or ""


def chosen_log_config(env: dict[str, str] | None = None) -> Path | None:
    """The file to hand TorchServe's launcher, or None for TorchServe's built-in."""
    value = _asked(env)
    if value == BUILT_IN:
        return None
    path = Path(value) if value else LOG_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{ENV}={value}: no such file (a log4j2 XML file, or '{BUILT_IN}')")
    return path.resolve()


def sets_log_config(ts_config: Path | None) -> bool:
    """True when the ts-config's vmargs name a log4j configuration file."""
    if ts_config is None or not Path(ts_config).is_file():
        return False
    for line in Path(ts_config).read_text().splitlines():
        key, _, value = line.strip().partition("=")
        if key.strip() == "vmargs" and "-Dlog4j.configurationFile=" in value:
            return True
    return False


def with_log_config(args: list[str], env: dict[str, str] | None = None) -> list[str]:
    """`torchserve` arguments with `--log-config` added unless the caller chose one."""
    if "--log-config" in args or any(a.startswith("--log-config=") for a in args):
        return args
    env = os.environ if env is None else env
    ts_config = env.get("TS_CONFIG_FILE") or _value_of(args, "--ts-config")
    if sets_log_config(Path(ts_config) if ts_config else None):
        return args
    path = chosen_log_config(env)
    return args if path is None else [*args, "--log-config", str(path)]


def _value_of(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


# REQUEST_LINE: TorchServe 0.12's worker logs it at info for every message it reads
# (ts/protocol/otf_message_handler.py, and packrat.worker_messages as it does, through the
# root logger, to stdout); the frontend reads it from the worker's stdout only to drop it
# (packrat/log4j2.xml) or copy it into model_log.log. The worker's [METRICS] lines, which
# the frontend turns into Prometheus metrics, are left alone.


class _DropRequestLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != REQUEST_LINE


def quiet_worker_request_lines(env: dict[str, str] | None = None) -> bool:
    """In a TorchServe worker: stop its per-request "Backend received inference" line at
    the source, unless TorchServe's built-in logging was asked for (ENV=torchserve).
    True when the filter is in place (installed now or before)."""
    if _asked(env) == BUILT_IN:
        return False
    root = logging.getLogger()
    if not any(isinstance(f, _DropRequestLine) for f in root.filters):
        root.addFilter(_DropRequestLine())
    return True


def worker_request_lines_quiet() -> bool:
    """True when this worker drops its per-request line (quiet_worker_request_lines ran)."""
    return any(isinstance(f, _DropRequestLine) for f in logging.getLogger().filters)


# TorchServe 0.12's worker adds its PredictionTime metric after every batch
# (ts/service.py): one "[METRICS]" line to stdout, a pipe write that wakes the frontend's
# reader thread, which matches, logs (packrat/log4j2.xml drops it), parses and sets a
# Prometheus gauge: the last batch's time. On a fast model that is one more wake-up on
# the workers' cores a batch and 1-2 % of a served worker's samples (py-spy, MiniLM at 8
# tokens: docs/benchmarks/efficiency-avx2-epyc.md). With one line a second the gauge shows
# a batch at most a second older than the last one.
PREDICTION_METRIC = "PredictionTime"


class ThinnedTimeMetric:
    """A worker metrics cache's add_time that adds `name` at most once every `every_s`
    seconds (the first time always; other metrics pass through): installed over the
    cache's own by thin_prediction_metric(). `skipped` counts what it left out."""

    def __init__(self, add_time: Callable[..., Any], every_s: float, name: str = PREDICTION_METRIC,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.add_time, self.every_s, self.name, self.clock = add_time, every_s, name, clock
        self.last: float | None = None
        self.skipped = 0

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == self.name:
            now = self.clock()
            if self.last is not None and now - self.last < self.every_s:
                self.skipped += 1
                return None
            self.last = now
        return self.add_time(name, *args, **kwargs)


def thin_prediction_metric(metrics: Any, every_s: float | None = None) -> bool:
    """In a TorchServe worker: let `metrics` (its context's metrics cache) write the
    PredictionTime line at most once every `every_s` seconds (None: the
    prediction_metric_s setting; 0 leaves TorchServe's line a batch). True when thinned
    (now or before)."""
    if every_s is None:
        every_s = settings.value_or_default("prediction_metric_s")  # a worker must serve anyway
    add_time = getattr(metrics, "add_time", None)
    if isinstance(add_time, ThinnedTimeMetric):
        return True
    if every_s <= 0 or add_time is None:
        return False
    metrics.add_time = ThinnedTimeMetric(add_time, float(every_s))
    return True
