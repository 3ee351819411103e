"""The settings table (packrat/settings.py): its docs page, its precedence, its errors, and
that it is the only reader of PACKRAT_* variables."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from packrat import settings
from packrat.settings import SettingError, help_for, lookup, value

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "settings.md"
NAME = re.compile(r"(?<![A-Za-z0-9_])PACKRAT_[A-Z0-9_]*[A-Z0-9]")


def test_the_docs_page_is_the_table() -> None:
    # Regenerate with: .venv/bin/python -m packrat.settings --markdown > docs/settings.md
    assert PAGE.read_text() == settings.markdown()


def test_the_page_comes_from_the_command_line() -> None:
    r = subprocess.run([sys.executable, "-m", "packrat.settings", "--markdown"], cwd=ROOT,
                       capture_output=True, text=True, check=True)
    assert r.stdout == settings.markdown()
    assert "| state_dir | `PACKRAT_STATE_DIR` | `--state-dir` | Path | `.packrat` |" in r.stdout


def test_cli_beats_the_environment_beats_the_default() -> None:
    env = {"PACKRAT_STATE_DIR": "/srv/state"}
    assert lookup("state_dir", cli=Path("/cli"), env=env) == (Path("/cli"), "cli")
    assert lookup("state_dir", env=env) == (Path("/srv/state"), "env")
    assert lookup("state_dir", env={}) == (Path(".packrat"), "default")
    assert lookup("state_dir", env={"PACKRAT_STATE_DIR": "  "}) == (Path(".packrat"), "default")  # empty: unset


def test_values_take_the_settings_type() -> None:
    assert value("load_nice", env={"PACKRAT_LOAD_NICE": " 10 "}) == 10
    assert value("forkserver", env={"PACKRAT_FORKSERVER": "Off"}) is False
    assert value("forkserver", env={"PACKRAT_FORKSERVER": "yes"}) is True
    assert value("forkserver", env={}) is True
    assert value("min_dwell_s", cli="90") == 90.0  # a CLI string is parsed like the environment's
    assert value("min_dwell_s", cli=12.5) == 12.5  # an already typed CLI value is kept
    assert value("cores", cli="0-3", env={"PACKRAT_CORES": "4"}) == "0-3"


def test_the_environment_is_read_when_no_mapping_is_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(tmp_path))
    assert lookup("slot_dir") == (tmp_path, "env")
    monkeypatch.delenv("PACKRAT_SLOT_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # the default is computed when read
    assert lookup("slot_dir") == (tmp_path / f"packrat-slots-{os.getuid()}", "default")


@pytest.mark.parametrize(("name", "raw", "expected"), [
    ("load_nice", "five", "expected a whole number"),
    ("forkserver", "maybe", "expected one of 1/true/yes/on/0/false/no/off"),
    ("api_port", "80a", "expected a whole number"),
])
def test_a_bad_value_names_the_variable_the_value_and_what_was_wanted(name: str, raw: str, expected: str) -> None:
    setting = settings.get(name)
    with pytest.raises(SettingError) as err:
        if setting.env:
            value(name, env={setting.env: raw})
        else:
            value(name, cli=raw)
    origin = setting.env or setting.options[0]
    assert str(err.value).startswith(f"{origin}={raw!r}: {expected}; {name}: {setting.help}")
    assert isinstance(err.value, ValueError)


def test_worker_settings_fall_back_to_the_default_on_a_bad_value() -> None:
    """What a TorchServe worker reads (it must serve whatever the environment says)."""
    assert settings.value_or_default("load_nice", env={"PACKRAT_LOAD_NICE": "five"}) == 5
    assert settings.value_or_default("load_nice", env={"PACKRAT_LOAD_NICE": "3"}) == 3
    assert settings.value_or_default("prediction_metric_s", env={"PACKRAT_PREDICTION_METRIC_S": "often"}) == 1.0
    assert settings.value_or_default("prediction_metric_s", env={"PACKRAT_PREDICTION_METRIC_S": "0.5"}) == 0.5


def test_an_unknown_setting_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="no setting 'state-dir'"):
        value("state-dir")


def test_help_texts_carry_the_default() -> None:
    assert help_for("tune_budget_s") == "seconds for the whole tune of one model [180]"
    assert help_for("min_dwell_s", "seconds between automatic swaps") == "seconds between automatic swaps [60]"
    assert help_for("slot_dir").endswith("[$TMPDIR/packrat-slots-<uid>]")
    assert help_for("cores") == settings.get("cores").help  # no default: no brackets


def test_every_setting_is_well_formed() -> None:
    for s in settings.SETTINGS.values():
        assert s.env or s.options, s.name
        assert s.env is None or NAME.fullmatch(s.env), s.name
        assert s.scope in settings.SCOPES, s.name
        assert "\n" not in s.help and "[" not in s.help, s.name  # one line; help_for adds the default
        default = s.default() if callable(s.default) else s.default
        assert default is None or isinstance(default, s.type), s.name
    envs = [s.env for s in settings.SETTINGS.values() if s.env]
    assert len(envs) == len(set(envs))


# -- nobody else reads PACKRAT_* variables ------------------------------------------------------

def _env_reads(source: str) -> list[str]:
    """"line: what" for each PACKRAT_* name written as a whole string constant (docstrings and
    comments are prose) and each use of getenv."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
            found.append(f"{node.lineno}: {node.value}")
        elif (isinstance(node, ast.Attribute) and node.attr == "getenv"
              or isinstance(node, ast.Name) and node.id == "getenv"):
            found.append(f"{node.lineno}: getenv")
    return found


def _sources() -> list[Path]:
    return [p for top in ("packrat", "handlers") for p in sorted((ROOT / top).rglob("*.py"))
            if p != ROOT / "packrat" / "settings.py"]


def test_only_the_settings_module_names_a_packrat_variable() -> None:
    found = [f"{p.relative_to(ROOT)}:{hit}" for p in _sources() for hit in _env_reads(p.read_text())]
    assert found == [], "read it through packrat.settings (value/lookup), add it to the table if new"


def test_the_checker_sees_a_read() -> None:
    src = ('"""PACKRAT_STATE_DIR in prose is fine."""\nimport os\n'
           'a = os.environ.get("PACKRAT_CORES")\nb = os.environ["PACKRAT_X"]\nc = os.getenv("HOME")\n')
    assert sorted(_env_reads(src)) == ["3: PACKRAT_CORES", "4: PACKRAT_X", "5: getenv"]


def test_every_variable_the_repository_names_is_in_the_table() -> None:
    # Shell scripts, manifests and tests name variables too: the page must list each one.
    # PACKRAT_CURLS is a shell array of scripts/run_demo.sh, not an environment variable.
    files = [p for top in ("packrat", "handlers", "scripts", "deploy", "tests", "plugin")
             for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in (".py", ".sh", ".yaml", ".java", "")]
    files = [p for p in files + [ROOT / "Makefile"] if p != Path(__file__).resolve()]
    named = {m for p in files for m in NAME.findall(p.read_text(errors="replace"))}
    named -= {"PACKRAT_CURLS", "PACKRAT_SHAPE_KEYS"}  # a shell array; a Python constant
    known = {s.env for s in settings.SETTINGS.values() if s.env}
    assert named - known == set()
    assert known - named == set(), "a variable in the table that nothing reads"


def test_the_pod_script_defaults_are_the_tables() -> None:
    script = (ROOT / "deploy" / "container" / "packrat-pod.sh").read_text()
    defaults = dict(re.findall(r"\$\{(PACKRAT_[A-Z_]+):-([^}$]+)\}", script))
    by_env = {s.env: s for s in settings.SETTINGS.values() if s.env}
    pod = {env: default for env, default in defaults.items() if by_env[env].scope == "pod"}
    assert pod and {env: by_env[env].default_text() for env in pod} == pod


def test_the_defaults_kept_elsewhere_agree_with_the_table() -> None:
    # Until each of these reads the table itself, a changed default must change both places.
    from packrat.control import values as control_values
    from packrat.observe.policy import PolicySettings
    from packrat.profile import library, runner
    from packrat.tune import run as tune_run

    assert PolicySettings().min_dwell_s == value("min_dwell_s")
    assert (tune_run.DEFAULT_BUDGET_S, tune_run.DEFAULT_POINT_BUDGET_S, tune_run.DEFAULT_BATCH,
            tune_run.DEFAULT_MAX_BATCH) == (value("tune_budget_s"), value("tune_point_budget_s"),
                                            value("tune_batch"), value("tune_max_batch"))
    assert (runner.DEFAULT_MAX_BATCH, runner.DEFAULT_POINT_BUDGET_S) == (
        value("profile_max_batch"), value("profile_point_budget_s"))
    # library and runner take theirs from the table; the controller's is a literal of its own.
    assert library.DEFAULT_STATE_DIR == control_values.DEFAULT_STATE_DIR == settings.get("state_dir").default


def test_the_background_check_interval_defaults_agree_and_a_bad_one_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    import typer

    from packrat.commands.control import LoopOptions, _check_s
    from packrat.control.tuning import AutoTuner, Reprofiler

    defaults = {inspect.signature(cls.__init__).parameters["interval_s"].default for cls in (AutoTuner, Reprofiler)}
    assert defaults == {LoopOptions().tune_check_s} == {value("tune_check_s")}
    monkeypatch.setenv("PACKRAT_TUNE_CHECK_S", "2.5")
    assert _check_s() == 2.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("PACKRAT_TUNE_CHECK_S", bad)
        with pytest.raises(typer.BadParameter, match="PACKRAT_TUNE_CHECK_S"):
            _check_s()
