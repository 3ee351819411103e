"""The tune's choice is faster where it counts: requests served by TorchServe.

test_tune.py checks the choice against the tuner's own numbers. Here the two
modes are made unmistakably different, and the served requests decide: the
test archive (tiny-bert, built in int8-eager) ships a test-only entry point
(SLOW_HANDLER, in this archive only, no hook in production code) that sleeps
SLEEP_MS per batch whenever the archive runs in its own mode, int8-eager. The
controller tunes it by itself (int8-eager against fp32-eager, default guard) and
must swap to fp32-eager, although the archive's own mode wins every near-tie;
then the tuned version and the archive's own mode (the same archive registered
under another name once the controller is gone) are timed
through TorchServe's inference API, one request each in turn, and the tuned one
must answer at least MARGIN times faster at the median. The sleep is a floor
under every answer of the own mode, so only a tuned path slower than
SLEEP_MS / MARGIN could fail it: ~5x what a tiny-bert eager request took on a busy
2-core machine (~30 ms). fp32-torchscript is not the fast side: on that machine its
tiny-bert requests (padded to max_length) took 140 ms served, 129 ms predicted.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import requests
import yaml

from packrat.archive import ArchiveOptions, build_named
from serving_support import ControllerProcess, registered_with_controller, start_server
from waiting import wait_until

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]

MODEL = "tf-bert"  # tuned by the controller
OWN = "tf-bert-own"  # the same archive, registered after the tune: serves its own mode
SLOW_MODE, FAST_MODE = "int8-eager", "fp32-eager"
SLEEP_MS = 300
MARGIN = 2.0
REQUESTS = 20  # per model, after WARMUP
WARMUP = 3
TUNE_TIMEOUT_S = 600  # a hang guard: the tune's own budget is TUNE_BUDGET_S
TUNE_BUDGET_S = 180  # a ceiling, not a wait: the tune ends once its points are measured

SLOW_HANDLER = f'''"""Test-only entry point (tests/test_tune_really_faster.py): the shipped handler, except
that every batch sleeps {SLEEP_MS} ms while the archive runs in {SLOW_MODE}."""

import time

import packrat_shipped_handler as shipped

SLOW_MODE = "{SLOW_MODE}"
_shipped_load_task = shipped.load_task


def _mode(config):
    section = (config or {{}}).get("packrat") or {{}}
    return f"{{section.get('precision', 'fp32')}}-{{section.get('runtime', 'eager')}}".lower()


def load_task(model_dir, model_yaml_config):
    task = _shipped_load_task(model_dir, model_yaml_config)
    if _mode(model_yaml_config) == SLOW_MODE:
        forward = task.forward

        def slow_forward(batch):
            time.sleep({SLEEP_MS} / 1000)
            return forward(batch)

        task.forward = slow_forward
    return task


shipped.load_task = load_task  # the shipped initialize() looks it up in its own module
initialize, handle = shipped.initialize, shipped.handle
'''


def _slow_archive(store: Path, name: str) -> None:
    """tiny-bert in SLOW_MODE as `name`, whose entry point is SLOW_HANDLER around the shipped one."""
    precision, runtime = SLOW_MODE.split("-")
    dst = build_named("tiny-bert", store, name, ArchiveOptions(precision=precision, runtime=runtime))
    (dst / "packrat_handler.py").rename(dst / "packrat_shipped_handler.py")
    (dst / "packrat_handler.py").write_text(SLOW_HANDLER)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("faster-store")
    _slow_archive(store, MODEL)
    state = tmp_path_factory.mktemp("faster-state")
    server = start_server(store, tmp_path_factory.mktemp("faster-ts"))
    extra = ["--no-adapt", "--tune-mode", FAST_MODE, "--tune-budget", str(TUNE_BUDGET_S), "--tune-batch", "2",
             "--tune-max-batch", "2", "--tune-point-budget", "1"]
    ctl = ControllerProcess(server, store, state, extra)
    with registered_with_controller(server, ctl, MODEL):  # it tunes the new model by itself
        yield server, ctl, store


def _wait_tune(ctl: ControllerProcess) -> dict:
    seen: list = [None]

    def finished() -> dict | None:
        seen[0] = tune = ctl.get(f"/v1/models/{MODEL}/tune").json()["tune"]
        return tune if tune and tune.get("state") in ("done", "failed") else None

    try:
        return wait_until(finished, TUNE_TIMEOUT_S, "the tune to finish", step_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {seen[0]}\n{ctl.log()}") from None


def _served_ms(session: requests.Session, url: str, headers: dict[str, str], body: bytes) -> float:
    t0 = time.perf_counter()
    r = session.post(url, data=body, headers=headers, timeout=120)
    ms = (time.perf_counter() - t0) * 1000
    assert r.status_code == 200 and "label" in r.text, (url, r.status_code, r.text)
    return ms


def test_the_tuned_mode_answers_faster_through_torchserve(stack) -> None:
    server, ctl, store = stack
    tune = _wait_tune(ctl)
    assert tune["state"] == "done", json.dumps(tune, indent=1)
    predicted = {m: v["plan"]["predicted_ms"] for m, v in tune["modes"].items()
                 if (v.get("plan") or {}).get("predicted_ms") is not None}
    assert tune["choice"]["mode"] == FAST_MODE, json.dumps(tune, indent=1)
    status = ctl.get(f"/v1/models/{MODEL}/status").json()
    assert status["mode"] == FAST_MODE and status["tune"]["stage"] == "applied", status
    live = yaml.safe_load((store / status["url"] / "model_config.yaml").read_text())["packrat"]
    assert (live["precision"], live["runtime"]) == tuple(FAST_MODE.split("-"))
    # Both measured: the own mode (int8, guarded against fp32 eager and passed) and the reference mode.
    assert {m: v["state"] for m, v in tune["modes"].items()} == {SLOW_MODE: "profiled", FAST_MODE: "profiled"}
    assert tune["modes"][SLOW_MODE]["guard"]["ok"], tune["modes"]
    ctl.kill()  # else it would tune OWN as well

    # The archive's own mode, served beside the tuned version: the base archive under another name.
    _slow_archive(store, OWN)
    server.register(OWN)

    headers = server.inference_headers()
    urls = {name: f"{server.inference_url}/predictions/{name}" for name in (MODEL, OWN)}
    times: dict[str, list[float]] = {MODEL: [], OWN: []}
    with requests.Session() as session:
        for i in range(WARMUP + REQUESTS):  # in turn, so both see the same machine
            body = json.dumps({"text": f"which mode is faster {i}"}).encode()
            for name in (MODEL, OWN):
                ms = _served_ms(session, urls[name], headers, body)
                if i >= WARMUP:
                    times[name].append(ms)
    tuned, own = statistics.median(times[MODEL]), statistics.median(times[OWN])
    print(f"served median: tuned {FAST_MODE} {tuned:.1f} ms, own {SLOW_MODE} {own:.1f} ms "
          f"({own / tuned:.1f}x); tuner predicted {predicted}")
    assert own >= SLEEP_MS  # the sleep really runs in the own mode's served path
    assert own >= MARGIN * tuned, (f"tuned {FAST_MODE} {tuned:.1f} ms is not {MARGIN}x faster than {SLOW_MODE} "
                                   f"{own:.1f} ms through TorchServe: {times}")
