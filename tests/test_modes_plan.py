"""Modes in the plan: one profile per execution mode, the best plan per mode, one choice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from packrat.errors import PlanError
from packrat.plan import MODE_MARGIN, plans_per_mode
from packrat.profile.store import save_profile
from packrat.types import Fingerprint, Profile, ProfilePoint


def _profile(mode: str, per_item_ms: float, overhead_ms: float) -> Profile:
    # L(t, b) = overhead + per_item * b / t for t in 1..2, b in 1, 2, 4
    points = tuple(ProfilePoint(threads=t, batch=b, mean_ms=overhead_ms + per_item_ms * b / t)
                   for t in (1, 2) for b in (1, 2, 4))
    fp = Fingerprint("AMD EPYC", 2, "glibc", "2.13.0", mode)
    return Profile(model_id=f"sha256:{mode}", points=points, fingerprint=fp,
                   extra={"model_name": f"m-{mode}"})


def test_each_mode_gets_its_plan_and_the_fastest_wins() -> None:
    fp32 = _profile("fp32-eager", per_item_ms=10.0, overhead_ms=1.0)
    bf16 = _profile("bf16-torchscript", per_item_ms=4.0, overhead_ms=3.0)
    per_mode, best = plans_per_mode([fp32, bf16], cores=2, batch=4)
    assert [m.mode for m in per_mode] == ["fp32-eager", "bf16-torchscript"]
    # fp32: 2 x (1 thread, b=2) = 1 + 10*2/1 = 21 ms vs fat (2, 4) = 1 + 10*4/2 = 21 ms -> 21
    assert per_mode[0].plan.predicted_latency_ms == 21.0
    # bf16: fat (2, 4) = 3 + 4*4/2 = 11 ms; 2 x (1, 2) = 3 + 8 = 11 ms -> 11
    assert per_mode[1].plan.predicted_latency_ms == 11.0
    assert best.mode == "bf16-torchscript"


def test_ties_go_to_the_first_profile_and_unplannable_modes_are_reported() -> None:
    a = _profile("fp32-onnxruntime", 10.0, 1.0)
    b = _profile("fp32-openvino", 10.0, 1.0)
    _, best = plans_per_mode([a, b], cores=2, batch=4)
    assert best.mode == "fp32-onnxruntime"
    _, best = plans_per_mode([b, a], cores=2, batch=4)
    assert best.mode == "fp32-openvino"
    # B = 16 > 2 instances x batch 4: no exact plan for either mode
    per_mode, best = plans_per_mode([a, b], cores=2, batch=16)
    assert best is None and all(m.plan is None and m.reason for m in per_mode)


def test_a_later_mode_must_beat_an_earlier_one_by_more_than_the_margin() -> None:
    # make run 11: GPT-2's own fp32-eager 2258 ms, bf16-eager 2236 ms (1 % faster, noise)
    own = _profile("fp32-eager", 10.0, 1.0)  # 21 ms at B = 4
    near = _profile("bf16-eager", 10.0, 0.5)  # 20.5 ms: 2.4 % faster
    far = _profile("bf16-openvino", 9.0, 1.0)  # 19 ms: 9.5 % faster
    _, best = plans_per_mode([own, near], cores=2, batch=4, margin=MODE_MARGIN)
    assert best.mode == "fp32-eager"
    _, best = plans_per_mode([own, near], cores=2, batch=4, margin=0.0)  # no margin: the fastest
    assert best.mode == "bf16-eager"
    _, best = plans_per_mode([own, near, far], cores=2, batch=4, margin=MODE_MARGIN)
    assert best.mode == "bf16-openvino"
    # The order is the preference: listed first, the near mode is kept over the own one.
    _, best = plans_per_mode([near, own], cores=2, batch=4, margin=MODE_MARGIN)
    assert best.mode == "bf16-eager"
    # Within the margin of the fastest, the earlier of two later modes wins too.
    _, best = plans_per_mode([own, far, _profile("int8s-openvino", 8.9, 0.9)], cores=2, batch=4,
                             margin=MODE_MARGIN)
    assert best.mode == "bf16-openvino"
    with pytest.raises(PlanError):
        plans_per_mode([own], cores=2, batch=4, margin=1.5)


def test_packrat_plan_with_several_profiles(tmp_path: Path) -> None:
    paths = []
    for mode, per_item, overhead in (("fp32-eager", 10.0, 1.0), ("int8-torchscript", 6.0, 1.0),
                                     ("bf16-openvino", 3.0, 2.0)):
        path = tmp_path / f"{mode}.json"
        save_profile(_profile(mode, per_item, overhead), path)
        paths += ["--profile", str(path)]
    cmd = [sys.executable, "-m", "packrat.cli", "plan", *paths, "--cores", "2", "--batch", "4"]
    r = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [m["mode"] for m in out["modes"]] == ["fp32-eager", "int8-torchscript", "bf16-openvino"]
    latencies = {m["mode"]: m["plan"]["predicted_latency_ms"] for m in out["modes"]}
    assert latencies == {"fp32-eager": 21.0, "int8-torchscript": 13.0, "bf16-openvino": 8.0}
    assert out["best"] == "bf16-openvino"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "choice    bf16-openvino: 8.000 ms" in r.stdout
    assert r.stdout.count("\n  fp32-eager") == 1


def test_packrat_plan_says_why_a_slower_mode_is_kept(tmp_path: Path) -> None:
    paths = []
    for mode, per_item, overhead in (("fp32-eager", 10.0, 1.0), ("bf16-eager", 10.0, 0.5)):
        path = tmp_path / f"{mode}.json"
        save_profile(_profile(mode, per_item, overhead), path)
        paths += ["--profile", str(path)]
    cmd = [sys.executable, "-m", "packrat.cli", "plan", *paths, "--cores", "2", "--batch", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "choice    fp32-eager: 21.000 ms" in r.stdout
    assert "kept before bf16-eager (20.500 ms), which is not more than 3% faster" in r.stdout
