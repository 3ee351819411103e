"""`packrat plan` end to end in a subprocess, and the profile loaders it uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from packrat.errors import ProfileError
from packrat.plan import optimal_plan
from packrat.profile import load_profile
from packrat.types import Plan
from packrat.profile.store import save_profile
from packrat.types import Fingerprint, Profile, ProfilePoint

# A copy of the paper's published profile, so this runs in CI (no ../shared there).
RESNET = Path(__file__).resolve().parent / "data" / "packrat-icml25" / "resnet-default.csv"


def packrat(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packrat.cli", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def small_csv(tmp_path: Path) -> Path:
    # L(t, b) = 10 * b / t at t, b in {1, 2, 4}; columns in another order plus an
    # extra one, which the loader must ignore.
    lines = ["batch,threads,latency_ms,notes"]
    for t in (1, 2, 4):
        for b in (1, 2, 4):
            lines.append(f"{b},{t},{10.0 * b / t},x")
    path = tmp_path / "small.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_json_shape_on_paper_profile():
    r = packrat("plan", "--profile", str(RESNET), "--cores", "16", "--batch", "24", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object, nothing else on stdout
    # the one plan wire format (packrat.types.Plan.to_dict), as REST and version files write it
    assert list(out) == ["cores", "batch", "predicted_latency_ms", "fat_latency_ms",
                         "expected_speedup", "realizable", "threads_used", "instances"]
    assert out["cores"] == 16 and out["batch"] == 24
    # 24 is not profiled: no fat baseline, no speedup
    assert out["fat_latency_ms"] is None and out["expected_speedup"] is None
    inst = out["instances"]
    assert all(list(i) == ["threads", "batch", "latency_ms"] for i in inst)
    assert sum(i["batch"] for i in inst) == 24
    assert sum(i["threads"] for i in inst) <= 16
    keys = [(i["threads"], i["batch"]) for i in inst]
    assert keys == sorted(keys, reverse=True)
    assert out["predicted_latency_ms"] == max(i["latency_ms"] for i in inst)
    # the same answer as the library on the same file
    lib = optimal_plan(load_profile(RESNET), 16, 24)
    assert out["predicted_latency_ms"] == lib.predicted_latency_ms
    assert Plan.from_dict(out).shape == lib.shape and out["realizable"] == lib.realizable


def test_json_small_profile_with_fat_and_speedup(small_csv: Path):
    r = packrat("plan", "--profile", str(small_csv), "--cores", "2", "--batch", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # T=2, B=2: 2 x (1,1) = 10 ms, (2,2) = 10 ms, (1,2) = 20 ms. Fewest instances: (2,2).
    assert out["instances"] == [{"threads": 2, "batch": 2, "latency_ms": 10.0}]
    assert out["fat_latency_ms"] == 10.0 and out["expected_speedup"] == 1.0


def test_realizable_json_and_table(small_csv: Path, tmp_path: Path):
    # Only batches 1, 2, 4 at threads 1, 2, 4 on T=3, B=3:
    # unconstrained: (2,2)+(1,1) = max(10, 10) = 10 ms.
    # realisable: cap 1 -> 3 x (1,1) = 10 ms (cap 2 -> 2 workers x 1 thread = 20 ms).
    r = packrat("plan", "--profile", str(small_csv), "--cores", "3", "--batch", "3",
                "--json", "--realizable")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["instances"] == [{"threads": 1, "batch": 1, "latency_ms": 10.0}] * 3
    plot = tmp_path / "plan.png"
    r = packrat("plan", "--profile", str(small_csv), "--cores", "3", "--batch", "3",
                "--plot", str(plot))
    assert r.returncode == 0, r.stderr
    assert "predicted latency  10.000 ms" in r.stdout
    assert "realisable" in r.stdout and "gap +0.0%" in r.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_profile_written_by_the_profiler(tmp_path: Path):
    fp = Fingerprint("Test CPU", 4, "glibc", "2.13.0", "fp32-eager")
    profile = Profile(
        model_id="sha256:abc",
        points=tuple(ProfilePoint(t, b, 5.0 * b / t, count=10) for t in (1, 2) for b in (1, 2)),
        fingerprint=fp,
        scope="model",
    )
    path = tmp_path / "p.json"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert loaded == profile
    r = packrat("plan", "--profile", str(path), "--cores", "2", "--batch", "2")
    assert r.returncode == 0, r.stderr
    assert "Test CPU" in r.stdout and "scope model" in r.stdout


def test_csv_loader_keeps_only_the_three_columns(small_csv: Path):
    p = load_profile(small_csv)
    assert p.latency(4, 2) == 5.0 and p.latency(2, 4) == 20.0
    assert len(p.points) == 9


@pytest.mark.parametrize(
    "content, message",
    [
        ("threads,batch\n1,1\n", "lacks column(s) latency_ms"),
        ("threads,batch,latency_ms\n", "no data rows"),
        ("threads,batch,latency_ms\n1,one,3\n", "batch must be"),
        ("threads,batch,latency_ms\n1,1,-3\n", "latency_ms must be a positive number"),
        ("threads,batch,latency_ms\n1,1,3\n1,1,4\n", "two points"),
    ],
)
def test_csv_loader_errors(tmp_path: Path, content: str, message: str):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_profile(path)


def _bad(tmp_path: Path) -> dict[str, list[str]]:
    nocols = tmp_path / "nocols.csv"
    nocols.write_text("model,instances,cores\nresnet,1,1\n")
    wide = tmp_path / "wide.csv"
    wide.write_text("threads,batch,latency_ms\n8,1,3.0\n")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    ok = tmp_path / "ok.csv"
    ok.write_text("threads,batch,latency_ms\n1,2,3.0\n")
    return {
        "missing file": ["--profile", str(tmp_path / "nope.csv"), "--cores", "2", "--batch", "2"],
        "csv without columns": ["--profile", str(nocols), "--cores", "2", "--batch", "2"],
        "cores zero": ["--profile", str(ok), "--cores", "0", "--batch", "2"],
        "cores negative": ["--profile", str(ok), "--cores", "-4", "--batch", "2"],
        "batch zero": ["--profile", str(ok), "--cores", "2", "--batch", "0"],
        "batch not a number": ["--profile", str(ok), "--cores", "2", "--batch", "two"],
        "no point usable for T": ["--profile", str(wide), "--cores", "2", "--batch", "1"],
        "batch not composable": ["--profile", str(ok), "--cores", "2", "--batch", "3"],
        "not json": ["--profile", str(garbage), "--cores", "2", "--batch", "2"],
        "plot unwritable": ["--profile", str(ok), "--cores", "2", "--batch", "2",
                            "--plot", str(tmp_path / "no" / "such" / "dir" / "x.png")],
    }


def test_bad_input_one_line_exit_2(tmp_path: Path):
    for case, args in _bad(tmp_path).items():
        r = packrat("plan", *args)
        assert r.returncode == 2, (case, r.stdout, r.stderr)
        assert r.stdout == "", case
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (case, r.stderr)
        assert "Traceback" not in r.stderr, case


def test_cover_flag(tmp_path: Path):
    # 2 cores, batches 1, 2, 4 at 1 thread: B=7 exactly needs 4+2+1 (3 instances,
    # 3 threads) -> exit 2; --cover: 2 x (1,4) = 23 ms covers 8 >= 7.
    path = tmp_path / "y.csv"
    path.write_text("threads,batch,latency_ms\n1,1,8\n1,2,13\n1,4,23\n2,4,14\n")
    r = packrat("plan", "--profile", str(path), "--cores", "2", "--batch", "7", "--json")
    assert r.returncode == 2 and "--cover" in r.stderr
    r = packrat("plan", "--profile", str(path), "--cores", "2", "--batch", "7", "--json", "--cover")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["instances"] == [{"threads": 1, "batch": 4, "latency_ms": 23.0}] * 2
