"""The build cache (handlers/packrat_tasks/build_cache.py): keyed so that a changed
archive or mode never loads a stale build, built once by concurrent workers, and
used by the next version's workers through a real TorchServe.

In process on the tiny BERT archive for the cache logic. The check that a second
version's workers load from the cache (through a TorchServe, token auth on, as
their status files and the swap record say) shares test_build_cache_trust.py's server.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from packrat.archive import build_named
from packrat_tasks import build_cache  # handlers/: on the path (pyproject's pythonpath)
from packrat_tasks import guard
from modes_support import noisy_runtime
from waiting import wait_until

MODES = ["fp32-onnxruntime", "fp32-torchscript", "fp32-openvino"]
WEIGHTS = "model/model.safetensors"


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A fresh store per test: its cache (beside the archive) starts empty."""
    build_named("tiny-bert", tmp_path, "bert")
    build_cache._digests.clear()  # each test edits archives: no digest of another test's files
    return tmp_path


def _new_process() -> None:
    """What a new worker process sees: no digest memoised (the archive may have changed)."""
    build_cache._digests.clear()


def _load(store: Path, mode: str, name: str = "bert"):
    import packrat_handler  # noqa: F401 - handlers/ is on sys.path

    config = copy.deepcopy(yaml.safe_load((store / name / "model_config.yaml").read_text()))
    config["packrat"]["precision"], config["packrat"]["runtime"] = mode.split("-", 1)
    return packrat_handler.load_task(str(store / name), config)


def _scores(task) -> torch.Tensor:
    batch = task.preprocess([{"body": b"the film was a delight"}, {"body": b"a cold meal, a rude waiter"}])
    return task.forward(batch).outputs.detach().float().clone()


def _flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _shift_classifier(store: Path, name: str = "bert") -> None:
    """Change a weight so that the outputs change (the classifier's bias + 1 on class 0)."""
    from safetensors.torch import load_file, save_file

    path = store / name / WEIGHTS
    tensors = load_file(str(path))
    key = next(k for k in tensors if k.endswith("classifier.bias"))
    tensors[key] = tensors[key].clone()
    tensors[key][0] += 1.0
    save_file(tensors, str(path), metadata={"format": "pt"})


# -- keys ------------------------------------------------------------------------------


def test_one_byte_of_a_weight_or_config_file_or_the_mode_changes_the_key(store: Path) -> None:
    def key(mode: str = "fp32-onnxruntime") -> Path:
        _new_process()
        return build_cache.artifact_dir(str(store / "bert"), mode, 1, {"what": "onnx"})

    first = key()
    assert key() == first  # deterministic
    assert key("fp32-openvino") != first and key("bf16-openvino") != first
    assert build_cache.artifact_dir(str(store / "bert"), "fp32-onnxruntime", 2, {"what": "onnx"}) != first

    for rel in (WEIGHTS, "model/config.json", "model/tokenizer.json"):
        original = (store / "bert" / rel).read_bytes()
        _flip_byte(store / "bert" / rel, len(original) // 2)
        assert key() != first, f"one byte of {rel} changed, the key did not"
        (store / "bert" / rel).write_bytes(original)
        assert key() == first

    config_path = store / "bert" / "model_config.yaml"
    original = config_path.read_text()
    config = yaml.safe_load(original)
    # What a swap writes per version does not change a build: versions of one base share it.
    config.update(batchSize=8, maxBatchDelay=40, minWorkers=2, maxWorkers=2)
    config["packrat"].update(plan_id="m-p7-abc", slots=[{"cores": [1], "threads": 1}], base="bert")
    config_path.write_text(yaml.safe_dump(config))
    assert key() == first
    # Anything else in it does (here the sequence length the text is padded to).
    config["packrat"]["max_length"] = int(config["packrat"].get("max_length", 128)) + 1
    config_path.write_text(yaml.safe_dump(config))
    assert key() != first
    config_path.write_text(original)


def test_file_digests_are_memoised_across_processes_and_versions_until_a_file_changes(
        store: Path, monkeypatch) -> None:
    """A new worker reuses the file digests another process computed (no 440 MB re-hash),
    also for a new version directory linking the same files (what every swap makes),
    but only while each file is as it was; a file changed within MEMO_SETTLE_S is
    hashed and never memoised (its stamp could survive a second write in the same tick)."""
    archive = str(store / "bert")
    time.sleep(build_cache.MEMO_SETTLE_S + 0.1)  # the archive was just built: let it settle
    first = build_cache.archive_digest(archive)
    weights = os.path.realpath(store / "bert" / WEIGHTS)
    memo_dir = build_cache._memo_dir(os.path.realpath(archive))
    assert memo_dir is not None
    memo = build_cache.memo_file(memo_dir, weights)
    assert memo.is_file()

    def no_hashing(path):
        raise AssertionError(f"hashed {path} again although its memo was valid")

    # A version directory as the controller writes it: links to the base's files and its
    # own model_config.yaml with only per-version keys changed.
    version = store / "bert.p1"
    version.mkdir()
    for entry in (store / "bert").iterdir():
        if entry.name != "model_config.yaml":
            os.symlink(Path("..") / "bert" / entry.name, version / entry.name)
    config = yaml.safe_load((store / "bert" / "model_config.yaml").read_text())
    config["batchSize"] = 7
    (version / "model_config.yaml").write_text(yaml.safe_dump(config))
    _new_process()
    with monkeypatch.context() as mp:
        mp.setattr(build_cache, "_hash_file", no_hashing)
        assert build_cache.archive_digest(archive) == first
        assert build_cache.archive_digest(str(version)) == first  # one build for every version

    _flip_byte(store / "bert" / WEIGHTS, 1000)
    _new_process()
    changed = build_cache.archive_digest(archive)
    assert changed != first
    assert build_cache._read_memo(memo, weights, build_cache._stamp(weights)) is None  # changed, racy
    memo.unlink()
    _new_process()
    assert build_cache.archive_digest(archive) == changed  # the same digest without any memo
    assert build_cache.archive_digest(str(version)) == changed


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    key_dir = tmp_path / "cache" / "k"
    log = tmp_path / "builds.log"
    ctx = multiprocessing.get_context("fork")
    # SIGTERM at its default in the pool's workers: a handler another test left in this process
    # (inherited by fork) would keep a worker alive through Pool.terminate() and hang the suite.
    with ctx.Pool(4, initializer=signal.signal, initargs=(signal.SIGTERM, signal.SIG_DFL)) as pool:
        out = pool.starmap(_slow_build, [(str(key_dir), str(log))] * 4)
    assert out == [str(key_dir)] * 4
    assert log.read_text().count("\n") == 1, log.read_text()  # one process built, three loaded
    assert (key_dir / "artefact").read_text() == "x" * 1000
    assert sorted(p.name for p in key_dir.parent.iterdir()) == ["k", "k.lock"]  # no temp dir left


def _slow_build(key_dir: str, log: str) -> str:
    def build(tmp: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough for every other process to reach the lock
        (tmp / "artefact").write_text("x" * 1000)

    return str(build_cache.build_once(Path(key_dir), build))


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    key_dir = tmp_path / "cache" / "k"

    def fail(tmp: Path) -> None:
        (tmp / "half").write_text("half an artefact")
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        build_cache.build_once(key_dir, fail)
    assert [p.name for p in key_dir.parent.iterdir()] == ["k.lock"]
    build_cache.build_once(key_dir, lambda tmp: (tmp / "whole").write_text("ok"))
    assert (key_dir / "whole").read_text() == "ok" and not (key_dir / "half").exists()


# -- what runtime.py caches ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_archive_never_loads_a_stale_build(store: Path, mode: str) -> None:
    if mode.endswith("openvino"):
        pytest.importorskip("openvino")
    first = _load(store, mode)
    assert first.runner.info["build_cache"] == {
        **{k: "built" for k in first.runner.info["build_cache"]}}, first.runner.info
    what = mode.split("-")[1] if mode.endswith("torchscript") else "onnx"
    assert first.runner.info["build_cache"][what] == "built"
    before = _scores(first)

    _new_process()
    again = _load(store, mode)
    assert again.runner.info["build_cache"][what] == "hit"
    assert again.runner.info["build_cache"]["guard"] == "hit"
    # ONNX Runtime / OpenVINO workers serve from the cache without loading the framework model.
    assert (again.model is None) == (what == "onnx")
    assert torch.allclose(_scores(again), before, atol=1e-5)
    assert again.run([{"body": b"a fine day"}])[0]["label"] == first.run([{"body": b"a fine day"}])[0]["label"]

    _shift_classifier(store)
    _new_process()
    changed = _load(store, mode)
    assert changed.runner.info["build_cache"][what] == "built"  # a new key, not the old build
    assert changed.runner.info["build_cache"]["guard"] == "built"  # re-guarded
    assert changed.model is not None  # nothing cached for this content: the model was loaded
    now = _scores(changed)
    reference = _scores(_load(store, "fp32-eager"))
    assert not torch.allclose(now, before, atol=1e-3)
    assert torch.allclose(now, reference, atol=1e-4), (now, reference)


def _hold_lock(path: str, held, release) -> None:
    from filelock import FileLock

    with FileLock(path):
        held.set()
        release.wait(3600)  # held until the test releases it: no timeout lets a waiter through


def _waiting_on_a_file_lock(thread: threading.Thread) -> bool:
    """`thread` is inside filelock's acquire (polling for a lock another process holds),
    read from its live stack; AssertionError if it already finished."""
    assert thread.is_alive(), "the load finished while the compile lock was held"
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "acquire" and "filelock" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _load_in_thread(store: Path, mode: str) -> tuple[threading.Thread, list]:
    loaded: list = []
    loader = threading.Thread(target=lambda: loaded.append(_load(store, mode)), daemon=True)
    loader.start()
    return loader, loaded


def test_a_written_openvino_blob_is_imported_without_waiting_for_the_compile_lock(store: Path) -> None:
    """The compile lock keeps workers from reading a blob still being written; once the
    blob is written a marker names it and later workers import it without the lock (with
    it, a swap's new workers imported one after the other). Deleting the blob sends
    workers back under the lock."""
    pytest.importorskip("openvino")
    first = _load(store, "fp32-openvino")
    assert first.runner.info["build_cache"]["openvino_blob"] == "built"
    (lock,) = store.glob(".packrat-build-cache/*/openvino-cache.lock")
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(lock), held, release))
    holder.start()
    try:
        assert held.wait(120), "stuck: the lock holder never took the lock"
        _new_process()
        # With the lock held for as long as the test runs, a load that waited for it
        # would never finish: finishing at all is the check (the bound is a hang guard).
        loader, loaded = _load_in_thread(store, "fp32-openvino")
        loader.join(300)
        assert not loader.is_alive(), "stuck: the load waited for the held compile lock despite the marker"
        again = loaded[0]
        assert again.runner.info["build_cache"]["openvino_blob"] == "hit"
        assert torch.allclose(_scores(again), _scores(first), atol=1e-5)
        cache = lock.with_suffix("")
        for blob in cache.iterdir():
            if not blob.name.startswith("."):
                blob.unlink()
        _new_process()
        loader, waited = _load_in_thread(store, "fp32-openvino")
        # no blob: it waits for the lock before compiling (seen in its stack, not inferred
        # from it being slow), and writes nothing while the lock is held
        wait_until(lambda: _waiting_on_a_file_lock(loader), 300, "the load to wait on the compile lock")
        assert not [b for b in cache.iterdir() if not b.name.startswith(".")]
    finally:
        release.set()
        holder.join(60)
    loader.join(300)
    assert waited and waited[0].runner.info["build_cache"]["openvino_blob"] == "built"


@pytest.fixture
def counted_broken_runtime():
    """A mode that disagrees with fp32 eager, counting how often it is built."""
    with noisy_runtime("test-counted") as built:
        yield built


def test_a_refused_mode_stays_refused_and_a_changed_archive_is_guarded_again(
        store: Path, counted_broken_runtime: list) -> None:
    with pytest.raises(guard.AccuracyGuardError) as first:
        _load(store, "fp32-test-counted")
    assert len(counted_broken_runtime) == 1
    _new_process()
    with pytest.raises(guard.AccuracyGuardError) as again:
        _load(store, "fp32-test-counted")
    # Refused from the cached verdict, with the same numbers, without building the mode.
    assert len(counted_broken_runtime) == 1
    assert again.value.report.metrics == first.value.report.metrics

    _shift_classifier(store)
    _new_process()
    with pytest.raises(guard.AccuracyGuardError):
        _load(store, "fp32-test-counted")
    assert len(counted_broken_runtime) == 2  # a changed archive: built and guarded again


# -- through TorchServe -----------------------------------------------------------------------

# That the next version's workers load from the cache is checked in test_build_cache_trust.py
# (test_the_next_versions_workers_load_from_the_cache_and_a_damaged_file_is_rebuilt_and_guarded),
# on the one TorchServe that also swaps to a damaged entry.
