"""Profile files, the archive content hash and the fingerprint rules."""

from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import replace

import pytest
import yaml

from packrat.errors import ConfigError, ProfileError, ProfileMismatchError
from packrat.profile import content_hash, load_profile, open_archive, save_profile
from packrat.profile.fingerprint import allocator, current_fingerprint, mode_from_config
from packrat.types import Fingerprint, Profile, ProfilePoint
from profile_support import make_tiny_archive

FP = Fingerprint(cpu_model="AMD EPYC", usable_cores=2, allocator="glibc", torch_version="2.13.0", mode="fp32-eager")


def _profile() -> Profile:
    return Profile(
        model_id="sha256:abc",
        points=(
            ProfilePoint(1, 1, 10.5, 10.4, 12.0, 0.3, 40, meta={"cpus_allowed_list": "0", "converged": True}),
            ProfilePoint(1, 2, 19.0, 18.9, 21.0, 0.5, 20),
            ProfilePoint(2, 1, 6.25, 6.2, 7.0, None, 1),
        ),
        fingerprint=FP,
        scope="model",
        extra={"omitted": [{"threads": 2, "batch": 2, "reason": "total budget exhausted"}], "model_name": "m"},
    )


def test_round_trip(tmp_path):
    path = tmp_path / "p.json"
    save_profile(_profile(), path)
    back = load_profile(path, expect_model_id="sha256:abc", expect_fingerprint=FP)
    assert back == _profile()  # model_id, points (values), fingerprint, scope
    assert back.points[0].meta == {"cpus_allowed_list": "0", "converged": True}
    assert back.extra["omitted"] == [{"threads": 2, "batch": 2, "reason": "total budget exhausted"}]
    data = json.loads(path.read_text())
    assert data["format"] == "packrat-profile/1" and data["model_name"] == "m"
    assert [(p["threads"], p["batch"]) for p in data["points"]] == [(1, 1), (1, 2), (2, 1)]


@pytest.mark.parametrize(
    "field,value",
    [("cpu_model", "Intel Xeon"), ("usable_cores", 16), ("allocator", "jemalloc"),
     ("torch_version", "2.8.0"), ("mode", "bf16-torchscript")],
)
def test_fingerprint_mismatch_is_an_error_unless_forced(tmp_path, field, value):
    path = tmp_path / "p.json"
    save_profile(_profile(), path)
    other = replace(FP, **{field: value})
    with pytest.raises(ProfileMismatchError, match=field):
        load_profile(path, expect_fingerprint=other)
    assert load_profile(path, expect_fingerprint=other, force=True).points == _profile().points


def test_model_id_mismatch_is_an_error_unless_forced(tmp_path):
    path = tmp_path / "p.json"
    save_profile(_profile(), path)
    with pytest.raises(ProfileMismatchError, match="model_id"):
        load_profile(path, expect_model_id="sha256:other")
    assert load_profile(path, expect_model_id="sha256:other", force=True).model_id == "sha256:abc"


@pytest.mark.parametrize(
    "content",
    ["not json", "[]", '{"points": []}', '{"model_id": "x", "points": [{"threads": 1}]}',
     '{"model_id": "x", "points": [{"threads": 1, "batch": 1, "mean_ms": -1}]}',
     '{"model_id": "x", "format": "packrat-profile/9", "points": []}',
     '{"model_id": "x", "points": [{"threads": 1, "batch": 1, "mean_ms": 1}, {"threads": 1, "batch": 1, "mean_ms": 2}]}'],
)
def test_malformed_files_are_profile_errors_not_mismatches(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert not isinstance(info.value, ProfileMismatchError)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="no such profile file"):
        load_profile(tmp_path / "nope.json")


def _edit_config(directory, **changes):
    path = directory / "model_config.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg.update(changes)
    path.write_text(yaml.safe_dump(cfg))


def test_content_hash_ignores_serving_shape_and_timestamps(tmp_path):
    d = make_tiny_archive(tmp_path / "a")
    base = content_hash(d)
    _edit_config(d, batchSize=32, minWorkers=3, maxWorkers=3, maxBatchDelay=7,
                 packrat={"plan_id": "p1", "slots": [{"cores": [0], "threads": 1}]})
    manifest = d / "MAR-INF" / "MANIFEST.json"
    m = json.loads(manifest.read_text())
    m.update(createdOn="02/02/2027 10:00:00", modelVersion="2.0")
    manifest.write_text(json.dumps(m))
    (d / "__pycache__").mkdir()
    (d / "__pycache__" / "packrat_handler.cpython-311.pyc").write_bytes(b"\0\1")
    assert content_hash(d) == base


@pytest.mark.parametrize("change", ["weights", "config", "code", "manifest_name"])
def test_content_hash_sees_what_changes_the_computation(tmp_path, change):
    d = make_tiny_archive(tmp_path / "a")
    (d / "weights.bin").write_bytes(b"\0" * 16)
    base = content_hash(d)
    if change == "weights":
        (d / "weights.bin").write_bytes(b"\0" * 15 + b"\1")
    elif change == "config":
        _edit_config(d, precision="bf16")
    elif change == "code":
        (d / "packrat_handler.py").write_text((d / "packrat_handler.py").read_text() + "\n# edit\n")
    else:
        manifest = d / "MAR-INF" / "MANIFEST.json"
        m = json.loads(manifest.read_text())
        m["model"]["modelName"] = "other"
        manifest.write_text(json.dumps(m))
    assert content_hash(d) != base


def test_mar_and_its_directory_have_the_same_id(tmp_path):
    d = make_tiny_archive(tmp_path / "a")
    mar = tmp_path / "tiny.mar"
    with zipfile.ZipFile(mar, "w") as zf:
        for p in sorted(d.rglob("*")):
            if p.is_file():
                zf.write(p, p.relative_to(d).as_posix())
    ref_dir, ref_mar = open_archive(d), open_archive(mar)
    assert ref_dir.model_id == ref_mar.model_id and ref_mar.model_name == "tiny"
    assert (ref_mar.directory / "packrat_handler.py").is_file()


def test_open_archive_rejects_what_is_not_an_archive(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        open_archive(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a Packrat archive"):
        open_archive(tmp_path / "empty")
    d = make_tiny_archive(tmp_path / "a")
    shutil.copy(d / "packrat_handler.py", tmp_path / "x.mar")
    with pytest.raises(ConfigError, match="not a readable .mar"):
        open_archive(tmp_path / "x.mar")


def test_allocator_from_environment():
    assert allocator({}) == "glibc"
    assert allocator({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432"}) == "glibc-tuned"
    assert allocator({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) == "glibc"
    assert allocator({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) == "jemalloc"
    assert allocator({"LD_PRELOAD": "libtcmalloc_minimal.so.4",
                      "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) == "tcmalloc"


def test_mode_and_current_fingerprint():
    assert mode_from_config({}) == "fp32-eager"
    assert mode_from_config({"packrat": {"task": "text-classification", "runtime": "torchscript"}}) == "fp32-torchscript"
    assert mode_from_config({"packrat": {"runtime": "eager", "precision": "bf16"}}) == "bf16-eager"
    fp = current_fingerprint({}, env={})
    assert fp.allocator == "glibc" and fp.usable_cores >= 1 and fp.torch_version.startswith("2.")


def test_contention_warning_flags_busy_points_only():
    from packrat.profile.runner import contention_warning

    quiet = ProfilePoint(1, 1, 10.0, meta={"cpu_share": 0.97, "loadavg_1m": [0.8, 1.1]})
    starved = ProfilePoint(1, 2, 30.0, meta={"cpu_share": 0.35, "loadavg_1m": [1.5, 1.9]})
    loaded = ProfilePoint(2, 1, 9.0, meta={"cpu_share": 0.9, "loadavg_1m": [6.0, 7.5]})
    assert contention_warning(replace(_profile(), points=(quiet,))) is None
    # Threads idle by nature (a sleeping handler's second thread): a low share, no wait for a core.
    idle = ProfilePoint(1, 2, 5.0, meta={"cpu_share": 0.5, "runq_share": 0.0, "runq_share_all": 0.01,
                                         "loadavg_1m": [0.8, 1.0]})
    assert contention_warning(replace(_profile(), points=(quiet, idle))) is None
    waited = replace(idle, meta={**idle.meta, "runq_share_all": 0.4})
    assert contention_warning(replace(_profile(), points=(quiet, waited))).startswith("warning: 1 of 2 points")
    warning = contention_warning(replace(_profile(), points=(quiet, starved, loaded)))
    # 2 busy points of 3; the worst load (7.5 > 2 cores) and the lowest share (0.35) are named
    assert warning.startswith("warning: 2 of 3 points") and "7.5 on 2 cores" in warning and "0.35" in warning


def test_a_profile_without_every_thread_count_is_not_reused_for_more_cores(tmp_path):
    """The tune reuses a mode's profile only if it has points at every thread count
    1..cores its plans may give a worker (a 1-core profile cannot plan 2-thread workers)."""
    from packrat.profile.library import check_mode_profile, expected_fingerprint

    config = {"packrat": {"precision": "fp32", "runtime": "eager"}}
    fp = expected_fingerprint(config, "fp32-eager")
    one_thread = Profile(model_id="sha256:abc", scope="handler", fingerprint=fp,
                         points=(ProfilePoint(1, 1, 10.0, 10.0, 11.0, 0.1, 20),
                                 ProfilePoint(1, 2, 19.0, 19.0, 20.0, 0.1, 20)))
    path = tmp_path / "fp32-eager.json"
    save_profile(one_thread, path)
    assert check_mode_profile(path, "fp32-eager", "sha256:abc", config).usable  # threads not asked
    assert check_mode_profile(path, "fp32-eager", "sha256:abc", config, cores=1).usable
    two = check_mode_profile(path, "fp32-eager", "sha256:abc", config, cores=2)
    assert not two.usable and two.problems == ("thread counts [1] do not cover 1..2",)
    both = replace(one_thread, points=one_thread.points + (ProfilePoint(2, 1, 6.0, 6.0, 7.0, 0.1, 20),))
    save_profile(both, path)
    assert check_mode_profile(path, "fp32-eager", "sha256:abc", config, cores=2).usable
