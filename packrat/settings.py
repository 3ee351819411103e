"""Every setting Packrat reads from the environment, and every shared CLI default: one table.

    SETTINGS["state_dir"]   Setting(env="PACKRAT_STATE_DIR", options=("--state-dir",), default=".packrat", ...)
    lookup(name, cli, env)  the value and where it came from: CLI > environment > default
    value(name, cli, env)   the value only
    help_for(name)          a CLI help text with its default, e.g. "seconds per model tune [180]"
    markdown()              docs/settings.md (`python -m packrat.settings --markdown` prints it)

Environment variables are read only here (tests/test_settings.py checks that no other
module of packrat/ or handlers/ names one): a variable's spelling, type, default and
meaning are written once. An empty variable counts as unset. A value that does not
parse raises SettingError, which names the variable, the value and what was expected.

Standard library only and no packrat import: TorchServe's Python worker imports it
(through packrat.slots and the handlers) before it pins its threads.

`scope` says who reads a setting: "packrat" (this package, the CLI included), "pod"
(the container entrypoint deploy/container/packrat-pod.sh, in shell), "scripts" or
"tests". The pod's and the scripts' variables are listed so that one page names every
PACKRAT_* variable; their defaults are the ones those shell scripts write.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A setting's value (from the environment or the CLI) does not parse."""


@dataclass(frozen=True)
class Setting:
    name: str
    type: type  # str, int, float, bool or Path
    default: Any  # None: unset (help says what then happens); a callable: computed when read
    help: str  # one line, no default in it (help_for adds it)
    env: str | None = None  # the PACKRAT_* variable, None: CLI only
    options: tuple[str, ...] = ()  # the CLI flags that set it
    scope: str = "packrat"  # who reads it: packrat, pod, scripts or tests
    shown_default: str | None = None  # the default as the docs write it, where repr would mislead

    def default_value(self) -> Any:
        """The default as read now (a callable default is computed)."""
        return self.default() if callable(self.default) else self.default

    def default_text(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.default is None:
            return ""
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)


def _slot_dir_default() -> Path:
    # Computed when read: tests and the server change TMPDIR before a worker starts. Per user:
    # another user could pre-create a shared name in /tmp, and the workers would refuse it.
    return Path(tempfile.gettempdir()) / f"packrat-slots-{os.getuid()}"


_TABLE: tuple[Setting, ...] = (
    # -- read by the package, environment first ------------------------------------------
    Setting("state_dir", Path, Path(".packrat"), "profiles, plans, tunes and the controller's state",
            env="PACKRAT_STATE_DIR", options=("--state-dir",)),
    Setting("slot_dir", Path, _slot_dir_default, "workers' slot locks and status files (made 0700 by the "
            "first worker; the controller must see the same one)",
            env="PACKRAT_SLOT_DIR", shown_default="$TMPDIR/packrat-slots-<uid>"),
    Setting("cores", str, None, "the cores Packrat plans on, a CPU list such as 0-3,8 (unset: affinity "
            "∩ cgroup cpuset, capped by the cgroup CPU quota)", env="PACKRAT_CORES", options=("--cores",)),
    Setting("load_nice", int, 5, "extra nice levels for a new worker's load and warm-up, 0..19 (0: leave "
            "the priority alone)", env="PACKRAT_LOAD_NICE"),
    Setting("frontend_nice", int, 10, "nice levels TorchServe's frontend runs above its workers when "
            "packrat-torchserve starts it with the fork server (make run, packrat serve too): the JVM's "
            "threads, which hand each batch to a worker and its answers to the clients, then need not wait "
            "for a worker's time slice when they wake; needs root or CAP_SYS_NICE, else the frontend "
            "stays as it is; 0..20 (0: leave it)", env="PACKRAT_FRONTEND_NICE"),
    Setting("prediction_metric_s", float, 1.0, "seconds between a worker's PredictionTime metric lines: "
            "TorchServe's worker writes one a batch, which its frontend wakes to read and parse into a "
            "gauge of the last batch's time; thinned, the gauge shows a batch at most this much older "
            "than the last one (0: one a batch, as TorchServe)", env="PACKRAT_PREDICTION_METRIC_S"),
    Setting("forkserver", bool, True, "fork TorchServe's workers and the profiler's from a warm "
            "interpreter (0: start each one in a new interpreter)", env="PACKRAT_FORKSERVER"),
    Setting("ts_log_config", str, None, "log4j2 file for TorchServe's frontend, or 'torchserve' for "
            "TorchServe's built-in logging (unset: packrat/log4j2.xml)", env="PACKRAT_TS_LOG_CONFIG"),
    Setting("build_cache", Path, None, "where workers keep built execution modes (unset: "
            ".packrat-build-cache/ beside the model directory)", env="PACKRAT_BUILD_CACHE"),
    Setting("build_cache_max_mb", float, 4096.0, "the build cache's size cap in MiB: after each build the "
            "least recently used entries no worker holds are evicted", env="PACKRAT_BUILD_CACHE_MAX_MB"),
    # -- CLI defaults shared by several commands ------------------------------------------
    Setting("model_store", Path, Path("model-store"), "TorchServe's model store", options=("--model-store",)),
    Setting("ts_config", Path, Path("config.properties"), "TorchServe config.properties (template)",
            options=("--config",)),
    Setting("ts_workdir", Path, Path(".packrat/torchserve"), "TorchServe frontend's working directory",
            options=("--workdir",)),
    Setting("management_url", str, "http://127.0.0.1:8081", "TorchServe's management API",
            options=("--management-url",)),
    Setting("metrics_url", str, "http://127.0.0.1:8082", "TorchServe's metrics API", options=("--metrics-url",)),
    Setting("api_host", str, "127.0.0.1", "the controller's REST API address (loopback by default)",
            options=("--host",)),
    Setting("api_port", int, 8085, "the controller's REST API port", options=("--port",)),
    Setting("api_url", str, "http://127.0.0.1:8085", "the controller's REST API", options=("--api",)),
    Setting("min_dwell_s", float, 60.0, "seconds between automatic swaps for a gain at the threshold (a "
            "larger predicted gain waits less: docs/observe.md)", options=("--min-dwell",)),
    Setting("tune_budget_s", float, 180.0, "seconds for the whole tune of one model",
            options=("--tune-budget", "--budget")),
    Setting("tune_point_budget_s", float, 5.0, "seconds per profiled point in a tune",
            options=("--tune-point-budget", "--point-budget")),
    Setting("tune_batch", int, 8, "load batch B a tune chooses for when none was observed",
            options=("--tune-batch", "--batch")),
    Setting("tune_max_batch", int, 8, "a tune profiles batches up to max(B, this)",
            options=("--tune-max-batch", "--max-batch")),
    Setting("tune_again_quiet_s", float, 30.0, "a tune that timed contended points (other work had "
            "the cores) measures those modes again, once, after the controller's cores were 60 % idle "
            "this many seconds (0: never)", env="PACKRAT_TUNE_AGAIN_QUIET_S"),
    Setting("tune_check_s", float, 10.0, "seconds between the background checks of every model: the "
            "auto-tuner's (which models need a tune) and, with --no-tune, the re-profiler's (did the "
            "traffic's input shape move)", env="PACKRAT_TUNE_CHECK_S"),
    Setting("profile_max_batch", int, 32, "largest batch `packrat profile` times (1, 2, 4, ... up to it)",
            options=("--max-batch",)),
    Setting("profile_point_budget_s", float, 10.0, "seconds per (threads, batch) point of `packrat profile`",
            options=("--point-budget",)),
    # -- the container entrypoint (deploy/container/packrat-pod.sh) ------------------------
    Setting("pod_model_store", Path, Path("/models"), "model store (--model-store)",
            env="PACKRAT_MODEL_STORE", scope="pod"),
    Setting("pod_ts_workdir", Path, Path("/var/lib/torchserve"), "TorchServe's working directory",
            env="PACKRAT_TS_WORKDIR", scope="pod"),
    Setting("pod_run_dir", Path, Path("/var/run/packrat"), "key file and slot directory go below it",
            env="PACKRAT_RUN_DIR", scope="pod"),
    Setting("pod_key_file", Path, None, "the key_file.json the script writes for the controller",
            env="PACKRAT_KEY_FILE", scope="pod", shown_default="$PACKRAT_RUN_DIR/keys/key_file.json"),
    Setting("pod_management_url", str, "http://127.0.0.1:18081", "TorchServe's management API "
            "(--management-url)", env="PACKRAT_MANAGEMENT_URL", scope="pod"),
    Setting("pod_metrics_url", str, "http://127.0.0.1:8082", "TorchServe's metrics API (--metrics-url)",
            env="PACKRAT_METRICS_URL", scope="pod"),
    Setting("pod_api_host", str, "127.0.0.1", "the controller's REST API address (--host; loopback: only "
            "the pod's auth proxy reaches it)",
            env="PACKRAT_API_HOST", scope="pod"),
    Setting("pod_api_port", int, 8085, "the controller's REST API port (--port)",
            env="PACKRAT_API_PORT", scope="pod"),
    Setting("pod_models", str, None, "model directories to load at start, space-separated",
            env="PACKRAT_MODELS", scope="pod"),
    Setting("pod_stop_grace_s", int, 45, "seconds TorchServe gets to stop before SIGKILL",
            env="PACKRAT_STOP_GRACE_S", scope="pod"),
    Setting("pod_controller_args", str, None, "extra controller flags, e.g. \"--no-tune --min-dwell 120\"",
            env="PACKRAT_CONTROLLER_ARGS", scope="pod"),
    Setting("pod_keys_dir", Path, Path("/etc/packrat/keys"), "Secret packrat-keys mounted as files: "
            "inference, management (16+ of A-Z a-z 0-9 _ -, different)", env="PACKRAT_KEYS_DIR", scope="pod"),
    Setting("pod_inference_key", str, None, "refused when set: every process would inherit it (keys come "
            "as files, PACKRAT_KEYS_DIR)", env="PACKRAT_INFERENCE_KEY", scope="pod"),
    Setting("pod_management_key", str, None, "refused when set: every process would inherit it (keys come "
            "as files, PACKRAT_KEYS_DIR)", env="PACKRAT_MANAGEMENT_KEY", scope="pod"),
    # -- scripts and tests ---------------------------------------------------------------
    Setting("free_ports", bool, False, "scripts/run_demo.sh: free ports instead of 8080-8082, "
            "and for the controller if 8085 is taken",
            env="PACKRAT_FREE_PORTS", scope="scripts"),
    Setting("plugin_python", Path, Path(".venv/bin/python"), "scripts/build_plugin.sh: the Python whose "
            "torchserve wheel holds model-server.jar", env="PACKRAT_PYTHON", scope="scripts"),
    Setting("status_screenshot", Path, None, "tests/test_status_page.py: where its screenshot goes "
            "(unset: the test's state dir)", env="PACKRAT_STATUS_SCREENSHOT", scope="tests"),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in _TABLE}
SCOPES = ("packrat", "pod", "scripts", "tests")


class Resolved(NamedTuple):
    value: Any
    source: str  # "cli", "env" or "default"


def get(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"no setting {name!r} in packrat.settings") from None


_EXPECTED = {bool: "one of " + "/".join(TRUE + FALSE), int: "a whole number", float: "a number"}


def parse(setting: Setting, raw: str, origin: str) -> Any:
    """`raw` as the setting's type; SettingError says which value, from where, and what was wanted."""
    text = raw.strip()
    try:
        if setting.type is bool:
            if text.lower() in TRUE + FALSE:
                return text.lower() in TRUE
            raise ValueError(text)
        return setting.type(text)
    except ValueError:
        expected = _EXPECTED.get(setting.type, setting.type.__name__)
        raise SettingError(f"{origin}={raw!r}: expected {expected}; {setting.name}: {setting.help}") from None


def lookup(name: str, cli: Any = None, env: Mapping[str, str] | None = None) -> Resolved:
    """The one precedence rule: a CLI value (not None) > the environment (`env`, default
    os.environ; empty = unset) > the table's default."""
    setting = get(name)
    if cli is not None:
        return Resolved(parse(setting, cli, setting.options[0] if setting.options else name)
                        if isinstance(cli, str) and setting.type is not str else cli, "cli")
    raw = (os.environ if env is None else env).get(setting.env, "") if setting.env else ""
    if raw.strip():
        return Resolved(parse(setting, raw, setting.env or name), "env")
    return Resolved(setting.default_value(), "default")


def value(name: str, cli: Any = None, env: Mapping[str, str] | None = None) -> Any:
    return lookup(name, cli, env).value


def value_or_default(name: str, env: Mapping[str, str] | None = None) -> Any:
    """value(), but the table's default where the variable does not parse: for code in a
    TorchServe worker, which must load and serve whatever the environment says."""
    try:
        return value(name, env=env)
    except SettingError:
        return get(name).default_value()


def help_for(name: str, text: str | None = None) -> str:
    """A CLI help text: `text` (else the table's) and the default in brackets, when there is one."""
    setting = get(name)
    shown = setting.default_text()
    base = text if text is not None else setting.help
    return f"{base} [{shown}]" if shown else base


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


_HEADINGS = {
    "packrat": "Read by Packrat (the CLI, the controller, the workers)",
    "pod": "Read by the container entrypoint (deploy/container/packrat-pod.sh)",
    "scripts": "Read by scripts",
    "tests": "Read by tests",
}


def markdown() -> str:
    """docs/settings.md, written from the table (a test keeps the file equal to it)."""
    lines = [
        "# Settings",
        "",
        "Generated from `packrat/settings.py` by `python -m packrat.settings --markdown > docs/settings.md`;",
        "tests/test_settings.py fails when this page and the table differ. Edit the table, not this page.",
        "",
        "Precedence: a CLI option > its environment variable > the default. An empty variable counts",
        "as unset; a value that does not parse is an error that names the variable.",
    ]
    for scope in SCOPES:
        lines += ["", f"## {_HEADINGS[scope]}", "",
                  "| Setting | Environment | CLI | Type | Default | Meaning |",
                  "|---|---|---|---|---|---|"]
        for s in (s for s in _TABLE if s.scope == scope):
            env = f"`{s.env}`" if s.env else ""
            opts = " ".join(f"`{o}`" for o in s.options)
            default = f"`{s.default_text()}`" if s.default_text() else ""
            lines.append(f"| {s.name} | {env} | {opts} | {s.type.__name__} | {_cell(default)} | {_cell(s.help)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if argv != ["--markdown"]:
        print("usage: python -m packrat.settings --markdown", file=sys.stderr)
        return 2
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
