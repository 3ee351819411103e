"""The profiler records a mode's build cost and guard numbers; one profile per mode feeds the plan."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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


MODES = (("fp32", "eager"), ("int8", "openvino"))


@needs_ov
def test_profile_per_mode_records_build_cost_and_plan_chooses(tmp_path: Path) -> None:
    # Both archives at once (~10 s each, mostly one core's imports): the profiles below,
    # which time the model, still run one at a time with nothing else running.
    with ThreadPoolExecutor(len(MODES)) as pool:
        built = list(pool.map(lambda m: packrat("archive", "tiny-bert", "-n", f"tb-{m[0]}-{m[1]}",
                                                "-o", str(tmp_path / "store"),
                                                "--precision", m[0], "--runtime", m[1]), MODES))
    for r in built:
        assert r.returncode == 0, r.stderr
    profiles = []
    for precision, runtime in MODES:
        name = f"tb-{precision}-{runtime}"
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
