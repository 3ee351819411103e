"""The controller reads the sizes a model's workers served (packrat.control.traffic):
summed over the live workers, shown in status and in /metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest

from packrat import slots
from packrat.api.answers import render_status
from packrat.control.traffic import TrafficShapes, served_sizes, shape
from packrat.control.values import ModelState, ModelStatus, WorkerState
from packrat.worker_counters import LiveCounters, size_bucket


def _state(model: str, pids: list[int]) -> ModelState:
    workers = tuple(WorkerState({"pid": pid, "status": "READY"}, None) for pid in pids)
    return ModelState(model=model, version="1", url=f"{model}.1", plan=None, workers=workers, other_versions=())


@pytest.fixture
def slot_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(tmp_path / "slots"))
    slots.secure_dir(slots.slot_root())
    slots.secure_dir(slots.slot_root() / "workers")
    return tmp_path / "slots"


def test_sizes_are_summed_over_the_live_workers(slot_dir: Path) -> None:
    one, two = LiveCounters(slots.worker_counters_path(101)), LiveCounters(slots.worker_counters_path(102))
    one.add_sizes({"tokens": [6] * 50})
    two.add_sizes({"tokens": [6] * 40 + [115] * 10})
    st = _state("bert", [101, 102, 103])  # 103: still starting, no counter file yet
    sizes = served_sizes(st)
    assert sizes["tokens"].requests == 100 and sizes["pixels"].requests == 0
    got = shape(sizes)
    assert set(got) == {"tokens"}  # kinds with no request are left out
    row = got["tokens"]
    assert row["requests"] == 100 and row["mean"] == pytest.approx((90 * 6 + 10 * 115) / 100, abs=0.1)
    assert 6 <= row["p50"] <= 7 and 6 <= row["p90"] <= 7  # 90 of the 100 are 6 tokens long
    assert served_sizes(_state("plain", [103])) is None and shape(None) is None
    assert shape(served_sizes(_state("idle", [104]))) is None
    LiveCounters(slots.worker_counters_path(104))
    assert shape(served_sizes(_state("idle", [104]))) == {}  # a worker, no traffic yet


def test_status_and_metrics_say_the_input_shape(slot_dir: Path) -> None:
    counters = LiveCounters(slots.worker_counters_path(201))
    counters.add_sizes({"pixels": [640 * 480] * 3, "tokens": [3]})
    traffic = TrafficShapes()
    registry = CollectorRegistry()
    registry.register(traffic)  # type: ignore[arg-type]
    assert b"packrat_traffic_size{" not in generate_latest(registry)  # nothing read yet
    st = _state("resnet", [201])
    status = render_status(ModelStatus(state=st, observed=None, swap_in_progress=None, last_swaps=(),
                                       adapt=None, traffic=traffic.update(st)))
    pixels = status["traffic"]["pixels"]
    assert pixels["requests"] == 3 and pixels["mean"] == 640 * 480
    assert size_bucket(int(pixels["p50"])) == size_bucket(640 * 480)
    text = generate_latest(registry).decode()
    assert 'packrat_traffic_requests{kind="pixels",model="resnet"} 3.0' in text
    assert f'packrat_traffic_size{{kind="pixels",model="resnet",stat="mean"}} {640 * 480}.0' in text
    assert 'packrat_traffic_size{kind="tokens",model="resnet",stat="p50"} 3.0' in text
    traffic.update_all([_state("other", [])])  # a tick that no longer lists resnet
    assert "resnet" not in generate_latest(registry).decode()


def test_profiles_and_tunes_take_the_traffics_sizes_and_a_shift_retunes(slot_dir: Path) -> None:
    from packrat.control.traffic import profile_sizes, why_retune
    from packrat.tune.run import _sizes_moved
    from packrat.types import Profile, TuneRecord

    counters = LiveCounters(slots.worker_counters_path(301))
    st = _state("bert", [301])
    assert profile_sizes(st, 8) == () and profile_sizes(_state("plain", [399]), 8) == ()  # the sample
    done = TuneRecord(model="bert", state="done", batch=1, detail={"sizes": {"tokens": 120}})
    assert why_retune(done, st) is None  # no traffic yet: nothing to compare
    counters.add_sizes({"tokens": [6] * 30})
    assert profile_sizes(st, 1) == (("tokens", 6),)
    assert why_retune(done, st) == "traffic's input shape moved (tokens 120 -> 6)"
    assert why_retune(TuneRecord(model="bert", state="done", batch=1, detail={"sizes": {"tokens": 7}}), st) is None
    # a tune whose sizes are not known (recorded by code from before a tune recorded its sample's):
    # tuned again once there is traffic; a failed one is not retried for it
    unknown = "input shape profiled at is not known (made before sizes were recorded); traffic's: tokens 6"
    assert why_retune(TuneRecord(model="bert", state="done", batch=1, detail={"sizes": {}}), st) == unknown
    assert why_retune(TuneRecord(model="bert", state="done", batch=1), st) == unknown
    assert why_retune(TuneRecord(model="bert", state="failed", batch=1), st) is None
    assert why_retune(TuneRecord(model="bert", state="running", batch=1), st) is None
    assert why_retune(None, st) is None  # never tuned: why_tune says so
    counters.add_sizes({"pixels": [50_000] * 30})
    assert why_retune(TuneRecord(model="bert", state="done", batch=1, detail={"sizes": {"tokens": 7}}), st) \
        .startswith("traffic's input shape moved (pixels none -> ")  # a kind the last tune had no traffic of
    # a saved profile is re-measured by a tune when it was made far from the traffic's sizes
    made_at = Profile(model_id="m", points=(), extra={"settings": {"sizes": [["tokens", 128]]}})
    assert _sizes_moved(made_at, (("tokens", 6),)) == ["tokens"]
    assert _sizes_moved(made_at, (("tokens", 110),)) == [] and _sizes_moved(made_at, ()) == []
    assert _sizes_moved(Profile(model_id="m", points=()), (("tokens", 6),)) == ["tokens"]  # sizes not known


@pytest.mark.torchserve
def test_a_controller_reports_what_a_real_worker_served(torchserve, tiny_store: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from serving_support import ControllerProcess, ensure_registered, predict, worker_pids

    ensure_registered(torchserve, "minilm")
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(torchserve.slot_dir))
    st = _state("minilm", worker_pids(torchserve, "minilm"))
    before = served_sizes(st)
    texts = ["short text", "a somewhat longer text about the traffic a model actually serves, in tokens"]
    for text in texts:
        assert predict(torchserve, "minilm", text.encode()).status_code == 200
    served = shape(served_sizes(st))
    assert served["tokens"]["requests"] == before["tokens"].requests + len(texts)
    ctl = ControllerProcess(torchserve, tiny_store, tmp_path / "state", ["--no-adapt", "--no-tune"],
                            ready_path="/healthz")
    try:
        ctl.start()
        status = ctl.get("/v1/models/minilm/status")
        assert status.status_code == 200, status.text
        assert status.json()["traffic"] == served  # what the workers counted, read by the controller
        metrics = requests.get(f"{ctl.url}/metrics", timeout=60).text
        count = float(served["tokens"]["requests"])
        assert f'packrat_traffic_requests{{kind="tokens",model="minilm"}} {count}' in metrics
        assert f'packrat_traffic_size{{kind="tokens",model="minilm",stat="p90"}} {served["tokens"]["p90"]}' in metrics
        line = subprocess.run([sys.executable, "-m", "packrat.cli", "status", "minilm", "--api", ctl.url,
                               "--key-file", str(torchserve.key_file)], capture_output=True, text=True, timeout=60)
        assert line.returncode == 0, line.stderr
        tokens = served["tokens"]
        assert f"[tokens p50 {tokens['p50']:g} p90 {tokens['p90']:g}]" in line.stdout, line.stdout
        _a_profile_through_rest_times_the_traffics_sizes(torchserve, ctl, st)
    finally:
        ctl.kill()


def _a_profile_through_rest_times_the_traffics_sizes(server, ctl, st: ModelState) -> None:
    """POST /profile after traffic: the profile is made at the traffic's representative
    size (the live version has no plan: B = 1, the median), and says so; a batch of 2 is
    timed at the longer of two texts (packrat.profile.shape.sizes_by_batch)."""
    import time

    from packrat.profile.shape import representative_sizes, sizes_by_batch
    from serving_support import predict

    for _ in range(20):  # a distribution: at least MIN_REQUESTS requests
        assert predict(server, "minilm", b"a text of some tokens for the profile").status_code == 200
    long_text = " ".join(["the longer texts of this traffic pad every batch they are in"] * 3).encode()
    for _ in range(200):  # until a batch of two is timed at other sizes than one text (the median)
        expected = representative_sizes(served_sizes(st), 1)
        by_batch = sizes_by_batch(served_sizes(st), [1, 2], expected)
        if by_batch:
            break
        assert predict(server, "minilm", long_text).status_code == 200
    assert expected and expected[0][0] == "tokens" and [b for b, _ in by_batch] == [2], by_batch
    job = requests.post(f"{ctl.url}/v1/models/minilm/profile", headers=ctl.headers(), timeout=60,
                        json={"max_batch": 2, "budget_s": 60, "cores": 1})
    assert job.status_code == 202, job.text
    deadline = time.monotonic() + 300  # a hang guard: the profile's own budget is 60 s
    while (state := ctl.get(f"/v1/jobs/{job.json()['id']}").json())["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, state
        time.sleep(1.0)
    assert state["state"] == "done", state
    profile = json.loads(Path(state["result"]["profile_path"]).read_text())
    assert Path(state["result"]["profile_path"]).with_suffix(".log").is_file()  # beside it, not in /tmp
    assert [tuple(pair) for pair in profile["settings"]["sizes"]] == list(expected)  # the label
    assert profile["settings"]["sizes_by_batch"] == [[2, [list(pair) for pair in by_batch[0][1]]]]
    assert [(p["batch"], p["meta"]["sizes"]) for p in profile["points"]] == [(1, dict(expected)),
                                                                            (2, dict(by_batch[0][1]))]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's functions")
def test_the_status_page_writes_the_traffic_and_the_tuned_sizes() -> None:
    """packrat/web/app.js's trafficText and tunedForText, run by node on status values."""
    js = (Path(__file__).resolve().parents[1] / "packrat" / "web" / "app.js").read_text()
    functions = "".join(re.search(rf"^function {name}\(.*?^}}$", js, re.M | re.S).group(0) + "\n"
                        for name in ("trafficText", "tunedForText"))
    cases = [["trafficText", {"tokens": {"requests": 240, "mean": 20.5, "p50": 6, "p90": 115}}],
             ["trafficText", {}], ["trafficText", None],
             ["tunedForText", {"sizes": {"tokens": 6}}], ["tunedForText", {"sizes": {}}], ["tunedForText", None]]
    script = functions + f"for (const [f, v] of {json.dumps(cases)}) console.log(eval(f)(v));"
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == ["tokens p50 6 p90 115 (240 requests)", "–", "–", "tokens 6",
                                       "the task's sample input", "–"]
