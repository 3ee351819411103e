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

from packrat.tslog import ENV, LOG_CONFIG, quiet_worker_request_lines, with_log_config, worker_request_lines_quiet
from serving_support import ensure_registered

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
