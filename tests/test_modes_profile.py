"""The profiler records a mode's build cost and guard numbers; one profile per mode feeds the plan."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from packrat.plan import MODE_MARGIN
from packrat.profile import load_profile

needs_ov = pytest.mark.skipif(
    importlib.util.find_spec("openvino") is None or importlib.util.find_spec("onnx") is None,
    reason="openvino/onnx not installed (pip install -e '.[runtimes]')")


def packrat(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packrat.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@needs_ov
def test_profile_per_mode_records_build_cost_and_plan_chooses(tmp_path: Path) -> None:
    profiles = []
    for precision, runtime in (("fp32", "eager"), ("int8", "openvino")):
        name = f"tb-{precision}-{runtime}"
        r = packrat("archive", "tiny-bert", "-n", name, "-o", str(tmp_path / "store"),
                    "--precision", precision, "--runtime", runtime)
        assert r.returncode == 0, r.stderr
        out = tmp_path / f"{name}.json"
        r = packrat("profile", str(tmp_path / "store" / name), "--cores", "1", "--max-batch", "2",
                    "--point-budget", "0.3", "-o", str(out), "-q")
        assert r.returncode == 0, r.stderr
        profile = load_profile(out)
        assert profile.fingerprint.mode == f"{precision}-{runtime}"
        mode = profile.extra["workers"][0]["mode"]
        assert mode["mode"] == f"{precision}-{runtime}" and mode["threads"] == 1
        assert mode["build_s"] > 0 and mode["rss_mb"] > 0
        if runtime == "eager":
            assert mode["guard"] is None  # fp32 eager is the reference itself
        else:
            assert mode["guard"]["ok"] is True and "max_prob_diff" in mode["guard"]["metrics"]
            assert mode["openvino"]["INFERENCE_NUM_THREADS"] == "1"
            assert "float32" in mode["openvino"]["INFERENCE_PRECISION_HINT"]  # set explicitly
        profiles += ["--profile", str(out)]
    r = packrat("plan", *profiles, "--cores", "1", "--batch", "2", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    latencies = {m["mode"]: m["plan"]["predicted_latency_ms"] for m in result["modes"]}
    assert set(latencies) == {"fp32-eager", "int8-openvino"}
    # The tune's rule (packrat.plan.modes): the first listed mode within MODE_MARGIN of the
    # fastest, so a later mode wins only when more than 3 % faster (the two can be that close).
    limit = min(latencies.values()) * (1.0 + MODE_MARGIN)
    assert result["best"] == next(m["mode"] for m in result["modes"] if latencies[m["mode"]] <= limit)
