"""`packrat torchserve keys|register|url` where no TorchServe runs: a clear error and exit 2,
never a traceback (they read <workdir>/server.json and key_file.json, which only a running
server leaves behind)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from packrat.cli import app
from packrat.server import Ports, RunningServer

COMMANDS = [["keys"], ["register", "noop"], ["url"], ["url", "metrics"]]


def _run(args: list[str], workdir: Path):
    return CliRunner().invoke(app, ["torchserve", *args, "--workdir", str(workdir)])


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_no_server_recorded_is_a_clear_error(tmp_path: Path, args: list[str]) -> None:
    r = _run(args, tmp_path / "nothing-here")
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "start one (make run, packrat torchserve start)" in r.output, r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("args", [["register", "noop"], ["url"]], ids=" ".join)
def test_a_dead_server_recorded_is_named_not_used(tmp_path: Path, args: list[str]) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid (and process group) is no one's now
    RunningServer(workdir=tmp_path, model_store=tmp_path, pid=gone.pid, ports=Ports(1, 2, 3, 4, 5),
                  config_path=tmp_path / "config.properties").save()
    r = _run(args, tmp_path)
    assert r.exit_code == 2, r.output
    assert f"(pid {gone.pid}) is not running" in r.output, r.output


def test_an_unreadable_record_is_named(tmp_path: Path) -> None:
    (tmp_path / "server.json").write_text("{not json")
    r = _run(["url"], tmp_path)
    assert r.exit_code == 2, r.output
    assert "server.json" in r.output and "start one" in r.output, r.output


def test_url_names_the_choices(tmp_path: Path) -> None:
    r = _run(["url", "bogus"], tmp_path)
    assert r.exit_code == 2
    said = " ".join(r.output.replace("│", " ").split())  # rich wraps the box's lines
    assert "'bogus' is not one of: inference, management, metrics" in said, r.output
