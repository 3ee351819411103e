"""An apply whose mode the new workers refuse (the accuracy guard, in the worker) is answered
as the caller's mistake, naming the guard's numbers, at the first refusal.

`packrat apply minilm --mode int8-eager` on the AVX2 EPYC: the guard refused int8-eager (min
cosine 0.92), TorchServe restarted the worker three times, and the answer was HTTP 500
"workers of minilm p2 keep dying while loading ...; see TorchServe's model_log.log".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from packrat.api.answers import error_status
from packrat.errors import ModeRefusedError, SwapError
from packrat.types import Instance, Plan
from serving_support import start_server, stop_in_background, usable_cores
from waiting import wait_until

MODEL = "strict-bert"
# int8 moves tiny-bert's probabilities by ~1e-3: with no difference allowed the guard must refuse.
STRICT = {"max_prob_diff": 0.0}
PLAN = Plan(cores=2, batch=1, instances=(Instance(1, 1, 0.0),), predicted_latency_ms=0.0, mode="int8-eager")


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory):
    """One TorchServe serving the strict archive (base version 1.0, one worker) for both
    refusal tests: an archive build, a JVM start and a tiny-bert worker's load each are
    seconds on 2 cores. Each test leaves it as it found it (only 1.0 loaded, asserted),
    so they pass in either order. Yields (server, model store)."""
    from packrat.archive import ArchiveOptions, build_named

    store = tmp_path_factory.mktemp("strict-store")
    build_named("tiny-bert", store, MODEL, ArchiveOptions(extra={"guard": STRICT}))
    server = start_server(store, tmp_path_factory.mktemp("strict-ts"))
    try:
        server.management_client().register(MODEL, MODEL, 1)
        yield server, store
    finally:
        stop_in_background(server)


def test_a_refused_mode_is_the_caller_s_mistake() -> None:
    assert error_status(ModeRefusedError("refused")) == 422
    assert error_status(SwapError("keep dying")) == 500


@pytest.mark.torchserve
@pytest.mark.slow
def test_an_apply_in_a_mode_the_guard_refuses_says_so_and_keeps_serving(strict, monkeypatch) -> None:
    from packrat.apply.swap import Swapper

    server, store = strict
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(server.slot_dir))  # the Swapper reads the status files
    client = server.management_client()
    assert [d.version for d in client.describe_versions(MODEL)] == ["1.0"]  # the base version, alone
    swapper = Swapper(client, store, cores=list(usable_cores(2)))
    with pytest.raises(ModeRefusedError) as refused:
        swapper.apply(MODEL, PLAN)
    message = str(refused.value)
    assert "refused mode int8-eager: AccuracyGuardError: accuracy guard REFUSED int8-eager" in message, message
    assert "(<= 0.0: FAIL)" in message and "keep dying" not in message
    record = refused.value.record
    assert record is not None and record.outcome == "rolled_back", record
    # Nothing changed for the model's users: the base version serves, alone.
    described = client.describe_versions(MODEL)
    assert [d.version for d in described] == ["1.0"], described
    r = requests.post(f"{server.inference_url}/predictions/{MODEL}", data=b"still served",
                      headers=server.inference_headers(), timeout=60)
    assert r.status_code == 200, r.text


def test_load_errors_come_from_the_workers_status_files(tmp_path: Path, monkeypatch) -> None:
    """What the swap quotes: each worker's own report of its failed load, a refusal told
    from an accident by the handler's error class."""
    from packrat.apply.swap import load_errors
    from packrat.errors import is_mode_refusal as refusal
    from packrat.slots import worker_status_path

    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(tmp_path / "slots"))
    reports = {101: "AccuracyGuardError: accuracy guard REFUSED int8-eager (...)",
               102: "OSError: [Errno 28] No space left on device", 103: None}
    for pid, error in reports.items():
        path = worker_status_path(pid)
        path.parent.mkdir(parents=True, exist_ok=True)
        startup = {"load_error": error} if error else {"loaded_at": 1.0}
        path.write_text(json.dumps({"pid": pid, "startup": startup}))
    # pid 104 has no status file (died before writing one): nothing to quote for it
    assert load_errors([104, 103, 102, 101, 102]) == [reports[101], reports[102]]
    assert [refusal(e) for e in load_errors([101, 102])] == [True, False]
    assert refusal("PrecisionError: packrat.precision bf16 needs a CPU with native bf16")


@pytest.mark.torchserve
@pytest.mark.slow
def test_a_last_plan_refused_after_a_restart_is_not_applied_again_and_again(strict, tmp_path: Path) -> None:
    """The restart watch applies the last plan again when TorchServe lost its version; if
    the workers now refuse its mode (the state dir moved to another CPU, say), each try
    loaded the model and was refused, every 30 s for as long as the controller ran."""
    from packrat.control import Controller, ControllerSettings

    server, store = strict
    assert [d.version for d in server.management_client().describe_versions(MODEL)] == ["1.0"]
    state = tmp_path / "state"
    state.mkdir()
    (state / "last-plans.json").write_text(json.dumps(
        {MODEL: {"version": "p7", "url": f"{MODEL}.p7", "plan": PLAN.to_dict()}}))
    settings = ControllerSettings(management_url=server.management_url, key_file=server.key_file,
                                  model_store=store, state_dir=state, cores=usable_cores(2),
                                  reapply_backoff_s=0.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PACKRAT_SLOT_DIR", str(server.slot_dir))
        c = Controller(settings)
        c.acquire()
        try:
            assert c.watch([MODEL]) == [MODEL]  # p7 is not loaded: applied again
            wait_until(lambda: c.swaps.running is None, 120, "the re-apply to end")
            assert MODEL not in c.files.last_plans()  # refused: forgotten
            assert c.watch([MODEL]) == []  # no backoff here, and still not tried again
            history = [json.loads(line) for line in (state / "swaps.jsonl").read_text().splitlines()]
            assert [h["outcome"] for h in history] == ["rolled_back"]
            assert "ModeRefusedError" in history[0]["error"], history[0]
        finally:
            c.release()
    assert [d.version for d in server.management_client().describe_versions(MODEL)] == ["1.0"]
