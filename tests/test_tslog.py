"""TorchServe's frontend starts with packrat/log4j2.xml unless the caller chose a log
configuration; with it, a request leaves one access-log line and nothing in ts_log or
model_log, and Prometheus still gets the latency counters the controller reads."""

from __future__ import annotations

import gzip
import logging
import re
import socket
import struct
from pathlib import Path

import pytest
import requests

from packrat.tslog import (
    ENV,
    LOG_CONFIG,
    PREDICTION_METRIC,
    ThinnedTimeMetric,
    quiet_worker_request_lines,
    thin_prediction_metric,
    with_log_config,
    worker_request_lines_quiet,
)
from serving_support import ensure_registered, start_server, stop_in_background, worker_pids

START = ["--start", "--foreground", "--ts-config"]


def test_packrat_log_config_is_added(tmp_path: Path) -> None:
    conf = tmp_path / "config.properties"
    conf.write_text("inference_address=http://127.0.0.1:1\n")
    args = with_log_config([*START, str(conf)], env={})
    assert args[-2:] == ["--log-config", str(LOG_CONFIG.resolve())]
    assert LOG_CONFIG.is_file()


def test_a_chosen_log_config_is_kept(tmp_path: Path) -> None:
    conf = tmp_path / "config.properties"
    conf.write_text("# vmargs=-Dlog4j.configurationFile=commented.xml\n")
    mine = tmp_path / "mine.xml"
    mine.write_text("<Configuration/>")
    # Explicit flag, in either spelling.
    for flag in (["--log-config", str(mine)], [f"--log-config={mine}"]):
        assert with_log_config([*START, str(conf), *flag], env={}) == [*START, str(conf), *flag]
    # The environment names another file, or TorchServe's built-in configuration.
    assert with_log_config([*START, str(conf)], env={ENV: str(mine)})[-1] == str(mine.resolve())
    assert with_log_config([*START, str(conf)], env={ENV: "torchserve"}) == [*START, str(conf)]
    with pytest.raises(FileNotFoundError, match=ENV):
        with_log_config([*START, str(conf)], env={ENV: str(tmp_path / "missing.xml")})
    # vmargs naming a log4j file: TorchServe's launcher would drop it for --log-config.
    conf.write_text(f"vmargs=-Xmx1g -Dlog4j.configurationFile=file://{mine}\n")
    assert with_log_config([*START, str(conf)], env={}) == [*START, str(conf)]
    assert with_log_config(["--start"], env={"TS_CONFIG_FILE": str(conf)}) == ["--start"]


@pytest.fixture
def root_filters():
    root = logging.getLogger()
    kept = list(root.filters)
    yield root
    root.filters[:] = kept


def _worker_reads_a_request() -> None:
    """TorchServe's worker code reading one (empty) inference message off its socket."""
    from ts.protocol.otf_message_handler import retrieve_msg

    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(b"I" + struct.pack("!i", -1))
        assert retrieve_msg(theirs) == (b"I", [])


def test_worker_request_line_is_dropped_at_the_source(root_filters, caplog) -> None:
    caplog.set_level(logging.INFO)
    _worker_reads_a_request()
    assert "Backend received inference at" in caplog.text  # TorchServe's line, as it writes it
    caplog.clear()
    before = len(root_filters.filters)
    assert not worker_request_lines_quiet()
    assert quiet_worker_request_lines(env={}) and quiet_worker_request_lines(env={})
    assert worker_request_lines_quiet()  # so the worker's own reader makes no record of it
    assert len(root_filters.filters) == before + 1  # a second call adds none
    _worker_reads_a_request()
    logging.info("Torch worker started.")  # the worker's other root lines pass
    logging.getLogger("ts.service").info("[METRICS]%s", "PredictionTime.Milliseconds:1.0")
    assert "Backend received inference" not in caplog.text
    assert "Torch worker started." in caplog.text and "[METRICS]PredictionTime" in caplog.text


def test_worker_request_line_stays_with_torchserves_logging(root_filters, caplog) -> None:
    caplog.set_level(logging.INFO)
    assert not quiet_worker_request_lines(env={ENV: "torchserve"})
    assert not worker_request_lines_quiet()  # the worker's own reader logs the line then
    _worker_reads_a_request()
    assert "Backend received inference at" in caplog.text


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _since(path: Path, offset: int) -> str:
    """What was written to `path` after it was `offset` bytes long."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


@pytest.mark.torchserve
def _whole_ts_log(logs: Path) -> list[str]:
    """ts_log.log with what log4j2 rolled out of it before (packrat/log4j2.xml rolls at
    midnight and at 100 MB into ts_log.<day>.log.gz), oldest first: a session server
    started before midnight has its start-up report in the rolled file."""
    rolled = sorted(logs.glob("ts_log.*.log.gz"), key=lambda p: p.stat().st_mtime)
    text = "".join(gzip.decompress(p.read_bytes()).decode("utf-8", "replace") for p in rolled)
    return (text + (logs / "ts_log.log").read_text()).splitlines()


def test_requests_leave_only_the_access_log_line(torchserve) -> None:
    """Only what this test's requests wrote is read (the session server's logs also hold
    every other module's lines), except the start-up report, written once per server."""
    ensure_registered(torchserve, "noop")
    url = f"{torchserve.inference_url}/predictions/noop"
    headers = torchserve.inference_headers()
    logs = torchserve.log_dir
    files = {name: logs / f"{name}.log" for name in ("access_log", "ts_log", "model_log")}
    offsets = {name: _size(path) for name, path in files.items()}
    bodies = [f"tslog request {i}".encode() for i in range(20)]
    for body in bodies:
        r = requests.post(url, data=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    access, ts_log, model_log = (_since(files[n], offsets[n]) for n in ("access_log", "ts_log", "model_log"))
    assert sum('"POST /predictions/noop' in line for line in access.splitlines()) >= len(bodies)
    # TorchServe's built-in configuration writes these for every request or batch.
    for per_request in ("Backend response time", "Looping backend response", "result=[METRICS]"):
        assert per_request not in ts_log
    assert "Backend received inference" not in model_log
    # The frontend's info lines (its start-up report, written before any test) still reach
    # ts_log, each once (the built-in configuration writes org.pytorch.serve's lines twice).
    whole = _whole_ts_log(logs)
    assert sum(line.startswith("Torchserve version") for line in whole) == 1
    start_up = whole[:next(i for i, line in enumerate(whole) if line.startswith("Torchserve version"))]
    lines = [re.sub(r"^\S+ ", "", line) for line in start_up if "org.pytorch.serve" in line]
    assert lines and not any(a == b for a, b in zip(lines, lines[1:]))
    # The counters the controller's observer reads come from the frontend, not the logs.
    metrics = requests.get(f"{torchserve.metrics_url}/metrics", timeout=30).text
    assert re.search(r'ts_inference_latency_microseconds\{model_name="noop"', metrics)
    # The worker's PredictionTime gauge too (its lines thinned to one a second, not dropped).
    assert re.search(r'PredictionTime\{ModelName="noop"', metrics)


def _worker_metrics_cache():
    """The metrics cache TorchServe 0.12's worker builds (its own class, its default
    metrics.yaml), as ts/service.py's predict() leaves it before adding PredictionTime."""
    import ts
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    cache = MetricsCacheYamlImpl(config_file_path=str(Path(ts.__file__).parent / "configs" / "metrics.yaml"))
    cache.initialize_cache()
    cache.model_name, cache.request_ids = "m", {0: "req-0"}
    return cache


def _metric_lines(caplog, name: str) -> int:
    return sum(r.getMessage().startswith(f"[METRICS]{name}.") for r in caplog.records)


def test_prediction_metric_is_written_at_most_once_an_interval(caplog) -> None:
    from ts.service import PREDICTION_METRIC as TS_NAME

    assert PREDICTION_METRIC == TS_NAME  # the name TorchServe's predict() adds
    caplog.set_level(logging.INFO)
    cache = _worker_metrics_cache()
    now = [100.0]
    thinned = ThinnedTimeMetric(cache.add_time, 1.0, clock=lambda: now[0])
    cache.add_time = thinned
    for t in (100.0, 100.2, 100.9, 101.0, 101.5, 103.0):  # a batch at each time
        now[0] = t
        cache.add_time(PREDICTION_METRIC, t)
        cache.add_time("HandlerTime", t)  # any other metric: every time
    assert _metric_lines(caplog, PREDICTION_METRIC) == 3  # at 100.0, 101.0 and 103.0
    assert _metric_lines(caplog, "HandlerTime") == 6
    assert thinned.skipped == 3
    written = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[METRICS]PredictionTime")]
    assert [w.split(":")[1].split("|")[0] for w in written] == ["100.0", "101.0", "103.0"]


def test_thin_prediction_metric_follows_its_setting(monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO)
    env = "PACKRAT_PREDICTION_METRIC_S"
    monkeypatch.setenv(env, "0")  # TorchServe's line a batch
    cache = _worker_metrics_cache()
    assert not thin_prediction_metric(cache)
    for _ in range(5):
        cache.add_time(PREDICTION_METRIC, 1.0)
    assert _metric_lines(caplog, PREDICTION_METRIC) == 5
    caplog.clear()
    monkeypatch.setenv(env, "30")
    assert thin_prediction_metric(cache)
    assert thin_prediction_metric(cache) and not isinstance(cache.add_time.add_time, ThinnedTimeMetric)
    assert cache.add_time.every_s == 30.0
    for _ in range(5):
        cache.add_time(PREDICTION_METRIC, 1.0)
    assert _metric_lines(caplog, PREDICTION_METRIC) == 1
    monkeypatch.setenv(env, "often")  # a worker must serve: the default, not an error
    other = _worker_metrics_cache()
    assert thin_prediction_metric(other) and other.add_time.every_s == 1.0
    assert not thin_prediction_metric(None)  # no metrics cache (not a TorchServe worker)


@pytest.mark.torchserve
@pytest.mark.slow
def test_served_batches_write_one_prediction_metric_a_second(tiny_store: Path, tmp_path: Path) -> None:
    """A real TorchServe logging its workers' metrics (metrics_mode=log: each line the
    frontend parses lands in model_metrics.log): many batches in a second leave about one
    PredictionTime line a second, and the frontend still has the metric."""
    server = start_server(tiny_store, tmp_path, extra_properties={"metrics_mode": "log"})
    try:
        ensure_registered(server, "noop")
        url = f"{server.inference_url}/predictions/noop"
        headers = server.inference_headers()
        metrics_log = server.log_dir / "model_metrics.log"
        offset = _size(metrics_log)
        import time

        n, t0 = 40, time.monotonic()
        for i in range(n):  # one after another, ~2.5 s in all: each its own batch
            r = requests.post(url, data=f"metric {i}".encode(), headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            time.sleep(0.06)
        elapsed = time.monotonic() - t0
        time.sleep(1.0)  # the frontend reads the worker's stdout on its own thread
        lines = [line for line in _since(metrics_log, offset).splitlines() if "PredictionTime" in line]
        # TorchServe's worker writes n; thinned: the first, then one a second at most (each worker).
        workers = len(worker_pids(server, "noop"))
        assert 2 <= len(lines) <= workers * (elapsed + 1), (elapsed, workers, lines)
        assert all("ModelName:noop" in line for line in lines)
    finally:
        stop_in_background(server)
