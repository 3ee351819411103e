"""`packrat status`'s line: the live plan's prediction names the input shape it is for (issue 32
item 3); a swap of the model under way leads its stage; without --api it asks the controller
`make run` wrote down (.packrat/controller.url: PACKRAT_FREE_PORTS=1 may have chosen another port)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from packrat.commands.tune import predicted_text, stage_text, traffic_text
from packrat.types import Instance, Plan, SwapRecord, ms_text
from serving_support import http_stand_in


def test_prediction_names_its_input_shape() -> None:
    assert predicted_text(65.61, {"tokens": 5}) == "predicted 65.6 ms for tokens 5"
    assert predicted_text(12.0, {"pixels": 50176, "tokens": 8}) == "predicted 12.0 ms for pixels 50176, tokens 8"
    # A plan made before sizes were recorded says so rather than implying one.
    assert predicted_text(3.25, None) == "predicted 3.2 ms (input shape not recorded)"
    assert predicted_text(None, {"tokens": 5}) == ""
    # With the live plan's load batch, as the tune's own "predicted ... at B=8" says it.
    assert predicted_text(8720.8, {"tokens": 5, "new_tokens": 20}, 8) == \
        "predicted 8720.8 ms at B=8 for tokens 5, new_tokens 20"
    assert predicted_text(3.25, None, 2) == "predicted 3.2 ms at B=2 (input shape not recorded)"


def test_traffic_text() -> None:
    assert traffic_text({"tokens": {"requests": 9, "mean": 7.1, "p50": 6, "p90": 115}}) == "tokens p50 6 p90 115"
    assert traffic_text(None) == "" and traffic_text({}) == ""


def test_a_running_swap_of_the_model_leads_its_stage() -> None:
    """Right after a restart the last tune still reads "applied ..." while the controller
    brings that plan's version up again (seen for ~20 s after `make stop; make run`)."""
    plan = Plan(cores=2, batch=8, instances=(Instance(1, 4, 15.5), Instance(1, 4, 15.5)), predicted_latency_ms=31.0,
                mode="int8s-openvino")
    running = SwapRecord(model="resnet50", from_version="1.0", to_version="p3", plan=plan, started_at=0.0,
                         phase="ready").to_dict()
    tune = {"text": "applied int8s-openvino 2x(t1,b4): predicted 31 ms at B=8"}
    st = {"model": "resnet50", "tune": tune, "swap_in_progress": running}
    assert stage_text(st) == ("swapping to int8s-openvino 2x(t1,b4) as version p3 (ready); "
                              "tune: applied int8s-openvino 2x(t1,b4): predicted 31 ms at B=8")
    # Another model's swap, or none, leaves the stage alone.
    assert stage_text({**st, "swap_in_progress": {**running, "model": "bert-base"}}) == tune["text"]
    assert stage_text({**st, "swap_in_progress": None}) == tune["text"]
    assert stage_text({"model": "noop", "tune": None, "swap_in_progress": None}) == "not tuned"
    # Before the new version has a name: the phase says where it is.
    early = SwapRecord(model="resnet50", from_version="1.0", to_version=None, plan=plan, started_at=0.0).to_dict()
    assert stage_text({**st, "swap_in_progress": early}).startswith("swapping to int8s-openvino 2x(t1,b4) (starting)")


def test_a_sub_millisecond_prediction_is_not_read_as_zero() -> None:
    """The no-op model's tune read "predicted 0 ms at B=8 (fat fp32-eager: 0 ms)" in `make run`."""
    assert predicted_text(0.0412, None) == "predicted 0.041 ms (input shape not recorded)"
    assert ms_text(0.0412, ".0f") == "0.041" and ms_text(1837.1, ".0f") == "1837" and ms_text(65.61) == "65.6"
    assert ms_text(0.0) == "0.0" and ms_text(0.5) == "0.50"  # as the status page (toPrecision) writes it


def test_a_lost_last_plan_leads_the_stage_until_its_swap_starts() -> None:
    tune = {"text": "applied int8s-openvino 2x(t1,b4): predicted 190 ms at B=8"}
    plan = {"mode": "int8s-openvino", "instances": [{"threads": 1, "batch": 4}] * 2}
    st = {"model": "resnet50", "tune": tune, "swap_in_progress": None,
          "lost_plan": {"version": "p1", "plan": plan, "retry_in_s": 0.0}}
    assert stage_text(st) == ("to apply its last plan again (int8s-openvino 2x(t1,b4): version p1 is no longer "
                              "loaded); tune: " + tune["text"])
    # A swap of another model runs meanwhile (the watch applies one at a time): still waiting.
    other = {"model": "bert-base", "plan": plan, "to_version": "p2", "phase": "ready"}
    assert stage_text({**st, "swap_in_progress": other}).startswith("to apply its last plan again")


def test_status_asks_the_controller_make_run_wrote_down(tmp_path: Path) -> None:
    keys = {k: {"key": f"{k}-key", "expiration time": "2999-01-01T00:00:00Z"} for k in ("management", "inference")}
    (tmp_path / "keys.json").write_text(json.dumps({**keys, "API": {"key": "api-key"}}))
    status = [sys.executable, "-m", "packrat.cli", "status", "--key-file", "keys.json"]
    with http_stand_in(lambda method, path: (200, "application/json", b"[]")) as (url, seen):
        (tmp_path / ".packrat").mkdir()
        (tmp_path / ".packrat" / "controller.url").write_text(f"{url}\n")
        out = subprocess.run(status, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert seen == [("GET", "/v1/models", "Bearer management-key")]
        # --api wins over the file; the file gone (make stop), the default port is asked.
        out = subprocess.run([*status, "--api", "http://127.0.0.1:9"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 1 and "http://127.0.0.1:9/v1/models" in out.stderr, out.stderr
        (tmp_path / ".packrat" / "controller.url").unlink()
        subprocess.run(status, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert len(seen) == 1  # not asked again: 8085's answer (or none) is not this test's
