"""The build cache trusts nothing it did not check (handlers/packrat_tasks/cache_entries.py).

A damaged entry (a truncated or flipped artefact, a file that still matches its
hashes but fails to load, a pointer out of the entry) is removed and built once
more, and the accuracy guard judges the new build; the cache is cut to its cap
(PACKRAT_BUILD_CACHE_MAX_MB) least recently used first, never an entry a live
process holds; temporary directories of dead builders are swept. In process on
the tiny BERT archive, each load a "new worker" (test_build_cache.py's helpers);
through TorchServe, the swaps that load from the cache and meet a damaged entry.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from packrat_tasks import build_cache, cache_entries  # handlers/: on the path (pyproject's pythonpath)
from test_build_cache import _flip_byte, _load, _new_process, _scores, store  # noqa: F401 - store: a fixture

ARTEFACT = {"fp32-torchscript": ("torchscript", "frozen.pt"), "fp32-onnxruntime": ("onnx", None),
            "fp32-openvino": ("onnx", None)}


def _entry(store: Path, what: str) -> Path:
    (entry,) = [p for p in (store / ".packrat-build-cache").iterdir()
                if p.is_dir() and f"-{what}-t" in p.name and not p.name.startswith(".")]
    return entry


def _artefact(entry: Path, mode: str) -> Path:
    name = ARTEFACT[mode][1] or (entry / "onnx-file").read_text().strip()
    return entry / name


def _rehash(entry: Path, name: str) -> None:
    """Record a file's current hash in the manifest: a damage the hashes cannot show."""
    manifest = json.loads((entry / cache_entries.MANIFEST).read_text())
    data = (entry / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (entry / cache_entries.MANIFEST).write_text(json.dumps(manifest))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip(path: Path) -> None:
    _flip_byte(path, len(path.read_bytes()) // 2)


@pytest.mark.parametrize("mode", list(ARTEFACT))
@pytest.mark.parametrize("damage", ["truncate", "flip", "loads-badly"])
def test_a_damaged_entry_is_removed_rebuilt_once_and_guarded_again(store: Path, mode: str, damage: str) -> None:
    if mode.endswith("openvino"):
        pytest.importorskip("openvino")
    what = ARTEFACT[mode][0]
    first = _load(store, mode)
    assert first.runner.info["build_cache"][what] == "built"
    before, entry = _scores(first), _entry(store, what)
    built_id = first.runner.info["artefacts"][what]
    artefact = _artefact(entry, mode)
    if damage == "truncate":
        _truncate(artefact)
    elif damage == "flip":
        _flip(artefact)
    else:  # garbage with matching hashes: only loading it shows the damage
        artefact.write_bytes(b"not a model at all")
        _rehash(entry, artefact.name)
    # the hashes show a truncated or flipped file; only loading shows the garbage that matches them
    assert (cache_entries.verify(entry, build_cache._sealing_digest) is None) == (damage == "loads-badly")

    _new_process()
    again = _load(store, mode)
    info = again.runner.info
    assert info["build_cache"][what] == "built", info  # rebuilt here, once
    assert info["artefacts"][what] != built_id
    assert info["build_cache"]["guard"] == "built" and again.runner.phases_s["guard"] > 0, info  # judged again
    assert again.runner.guard["ok"] and not again.runner.guard.get("cached")
    assert cache_entries.verify(_entry(store, what), build_cache._sealing_digest) is None  # one entry, whole
    assert torch.allclose(_scores(again), before, atol=1e-5)

    _new_process()
    third = _load(store, mode)  # the rebuilt entry and its new verdict are used as they are
    assert third.runner.info["build_cache"][what] == "hit"
    assert third.runner.info["build_cache"]["guard"] == "hit"


def test_a_damaged_openvino_blob_is_compiled_again(store: Path) -> None:
    pytest.importorskip("openvino")
    first = _load(store, "fp32-openvino")
    assert first.runner.info["build_cache"]["openvino_blob"] == "built"
    cache = _entry(store, "onnx") / "openvino-cache"
    (blob,) = [b for b in cache.iterdir() if not b.name.startswith(".")]
    _flip(blob)
    _new_process()
    again = _load(store, "fp32-openvino")
    assert again.runner.info["build_cache"]["onnx"] == "hit"  # the graph was intact
    assert again.runner.info["build_cache"]["openvino_blob"] == "built"  # the blob compiled again
    assert torch.allclose(_scores(again), _scores(first), atol=1e-5)
    _new_process()
    assert _load(store, "fp32-openvino").runner.info["build_cache"]["openvino_blob"] == "hit"


def test_a_pointer_out_of_the_entry_is_refused_and_the_entry_rebuilt(store: Path) -> None:
    first = _load(store, "fp32-onnxruntime")
    entry = _entry(store, "onnx")
    name = (entry / "onnx-file").read_text().strip()
    for bad in ("../../model/model.safetensors", "/etc/passwd", "..", "", "key.json.missing"):
        with pytest.raises(ValueError, match="points to"):
            build_cache.entry_file(entry, bad)
    assert build_cache.entry_file(entry, name + "\n") == entry / name
    (entry / "onnx-file").write_text("../../bert/model_config.yaml")
    _rehash(entry, "onnx-file")  # consistent hashes: the pointer check alone refuses it

    _new_process()
    again = _load(store, "fp32-onnxruntime")
    assert again.runner.info["build_cache"]["onnx"] == "built"
    assert (_entry(store, "onnx") / "onnx-file").read_text().strip() == name
    assert torch.allclose(_scores(again), _scores(first), atol=1e-5)


# -- the cap -----------------------------------------------------------------------------------


def _build_in_child(key_dir: str, kib: int) -> None:
    """A worker that builds one entry and exits (releasing its hold on it)."""
    build_cache.build_once(Path(key_dir), lambda tmp: (tmp / "blob").write_bytes(os.urandom(kib * 1024)))


def _hold_in_child(key_dir: str, held, release) -> None:
    assert build_cache.use(Path(key_dir))
    held.set()
    release.wait(600)


def _in_child(target, *args) -> None:
    proc = multiprocessing.get_context("fork").Process(target=target, args=args)
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "digests")


def _bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def test_the_cache_stays_under_its_cap_evicting_the_least_recently_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKRAT_BUILD_CACHE_MAX_MB", str(200 / 1024))  # 200 KiB: three 60 KiB entries
    root = tmp_path / "cache"
    for name in ("a", "b", "c"):
        _in_child(_build_in_child, str(root / name), 60)
        time.sleep(0.05)  # distinct last-use stamps
    assert _entries(root) == ["a", "b", "c"]
    assert build_cache.use(root / "a")  # a used again, and held by this process from now on
    _in_child(_build_in_child, str(root / "d"), 60)  # over the cap: b, the least recently used, goes
    assert _entries(root) == ["a", "c", "d"] and _bytes(root) <= 200 * 1024
    for name in ("e", "f", "g", "h"):  # 4 x 60 KiB more than the cap allows
        _in_child(_build_in_child, str(root / name), 60)
        assert _bytes(root) <= 200 * 1024, _entries(root)
    assert "a" in _entries(root) and "h" in _entries(root)  # held by this process; just built


def test_an_entry_in_use_by_another_process_is_never_evicted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKRAT_BUILD_CACHE_MAX_MB", str(100 / 1024))
    root = tmp_path / "cache"
    _in_child(_build_in_child, str(root / "old"), 60)
    ctx = multiprocessing.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_in_child, args=(str(root / "old"), held, release))
    holder.start()
    try:
        assert held.wait(60)
        _in_child(_build_in_child, str(root / "new"), 60)  # over the cap, but "old" is in use
        assert _entries(root) == ["new", "old"]
    finally:
        release.set()
        holder.join(60)
    _in_child(_build_in_child, str(root / "newer"), 10)  # the holder has exited: now it goes
    assert "old" not in _entries(root) and _bytes(root) <= 100 * 1024


def test_temporary_directories_of_dead_builders_are_swept(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    _in_child(_build_in_child, str(root / "a"), 1)
    stale = root / ".b.tmp-999999-abcdef"
    stale.mkdir()
    (stale / "half").write_bytes(b"x" * 100)
    fresh = root / ".c.tmp-999998-abcdef"  # a build still running: young
    fresh.mkdir()
    old = time.time() - cache_entries.STALE_TMP_S - 60
    os.utime(stale, (old, old))
    _in_child(_build_in_child, str(root / "d"), 1)
    assert not stale.exists() and fresh.exists()


def test_an_entry_is_durable_and_complete_before_it_is_visible(tmp_path: Path) -> None:
    key_dir = build_cache.build_once(tmp_path / "cache" / "k", lambda tmp: (tmp / "f").write_text("data"))
    manifest = json.loads((key_dir / cache_entries.MANIFEST).read_text())
    assert manifest["files"]["f"] == {"size": 4, "sha256": hashlib.sha256(b"data").hexdigest()}
    assert build_cache.build_id(key_dir) == manifest["build"]
    assert sorted(p.name for p in key_dir.parent.iterdir()) == ["k", "k.lock"]


# -- through TorchServe -----------------------------------------------------------------------


@pytest.mark.torchserve
@pytest.mark.slow
def test_the_next_versions_workers_load_from_the_cache_and_a_damaged_file_is_rebuilt_and_guarded(
        tiny_store: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Through a real TorchServe (token auth on), swaps of one model: the next version's workers
    load from the cache (their status files and the swap record say so); then a version whose
    cached file was damaged still goes live. One server for both (each its own cost ~10 s):
    was test_build_cache.py's test_the_next_versions_workers_load_from_the_cache and
    test_a_swap_to_a_mode_whose_cached_file_was_damaged_succeeds_and_is_guarded.
    Before: every worker of the mode loaded the damaged file and failed; the swap rolled back."""
    from packrat.types import Instance, Plan
    from serving_support import predict, swapper_on_a_copy

    def plan(workers: int) -> Plan:
        return Plan(cores=2, batch=2, instances=(Instance(1, 2, 0.0),) * workers,
                    predicted_latency_ms=0.0, mode="fp32-onnxruntime")

    with swapper_on_a_copy(tiny_store, tmp_path_factory, "tiny-bert", "trust-bert") as (server, store, swapper):
        first = swapper.apply("trust-bert", plan(1))
        answer = predict(server, "trust-bert", b"the film was a delight").json()
        second = swapper.apply("trust-bert", plan(2))
        assert predict(server, "trust-bert", b"the film was a delight").json() == answer
        entry = _entry(store, "onnx")
        _flip(_artefact(entry, "fp32-onnxruntime"))
        third = swapper.apply("trust-bert", plan(2))  # raises if it rolled back
        assert predict(server, "trust-bert", b"the film was a delight").json() == answer
    for name, rec in (("first", first), ("second", second), ("third", third)):
        print(name, rec.to_dict()["ready_phases_s"], rec.workers)
    # The first onnxruntime worker exported and guarded; the next version's two workers loaded both.
    assert [w["cache"] for w in first.workers] == [{"onnx": "built", "guard": "built"}]
    assert [w["cache"] for w in second.workers] == [{"onnx": "hit", "guard": "hit"}] * 2
    # the guard ran for the build (tens of ms on 8 samples), not for the hits
    assert first.workers[0]["phases_s"]["guard"] > 0.0
    assert all(w["phases_s"]["guard"] == 0.0 for w in second.workers)
    for rec in (first, second):
        assert [k for k, _ in rec.ready_phases_s] == [
            "worker_start", "model_load", "mode_build", "guard", "warmup", "ready_check"]
        names = [k for k, _ in rec.phases_s]
        assert names == ["create", "register", "ready", "set_default", "drain", "retire", "unregister"]
    # The damage was found, the file rebuilt once (the other worker waited and loaded it) and
    # judged again by the guard, by every worker: the verdict named the damaged build.
    assert sorted(w["cache"]["onnx"] for w in third.workers) == ["built", "hit"], third.workers
    assert all(w["cache"]["guard"] == "built" and w["phases_s"]["guard"] > 0 for w in third.workers)
    assert cache_entries.verify(_entry(store, "onnx"), build_cache._sealing_digest) is None
