"""Shared fixtures: tiny archives built once per session, real TorchServe per module.

`tiny_store` builds every tiny archive into one temporary model store (seeded
weights, local tokenizers, ~30 s). `torchserve` starts one TorchServe on free
loopback ports for the session, token authorisation on, and stops it — also
when tests fail; modules register the archives they need (ensure_registered)
and undo whatever else they change on it.

Tests and fixtures stop the servers they started in the background (serving_support.
stop_in_background: TorchServe's shutdown waits ~2.5 s, almost no CPU) where
no test reads anything of them afterwards; the session joins every such stop
and fails if one raised or left a process.

Every TorchServe a test starts gets its own slot directory inside its workdir
(serving_support.start_server), removed when it stops; servers started by
packrat code under test (the benchmark, the adaptation rig) and their
in-process controllers share one directory per test session, also removed.

Hypothesis: profile "ci" (loaded when CI is set) is derandomized and keeps no
example database, so a CI failure reproduces by running the same commit
again; profile "dev" (otherwise) explores with a fresh seed per run, printed
in the header: rerun with `--hypothesis-seed=N`. Both print the failing
example's reproduction blob. `--hypothesis-profile` or HYPOTHESIS_PROFILE
picks one explicitly. Loaded here, before any test module builds its own
`settings(...)`, so those inherit it.

PACKRAT_TUNE_AGAIN_QUIET_S is 0 (off) for the session unless set: a tune timed while the
suite loads the machine would otherwise be measured again by itself in any test that
runs a controller long enough.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

from packrat.server import RunningServer
from serving_support import background_stops_joined, start_server, stop_in_background

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

# Controllers the tests start (subprocesses inherit this) do not measure a busy tune again
# on their own: which tunes run stays each test's to say. tests/test_tune_busy.py turns it on.
os.environ.setdefault("PACKRAT_TUNE_AGAIN_QUIET_S", "0")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Before hypothesis' own pytest_configure reads the option: force one seed for
    # the run unless given or derandomized, so it can be printed and reused.
    profile = config.getoption("hypothesis_profile", None) or settings.get_current_profile_name()
    if config.getoption("hypothesis_seed", None) is None and not settings.get_profile(profile).derandomize:
        config.option.hypothesis_seed = str(random.SystemRandom().randrange(2**32))


def _hypothesis_line(config: pytest.Config) -> str:
    seed = config.getoption("hypothesis_seed", None)
    how = f"seed {seed} (rerun: --hypothesis-seed={seed})" if seed is not None else "derandomized"
    return f"hypothesis profile {settings.get_current_profile_name()!r}: {how}"


def pytest_report_header(config: pytest.Config) -> str:
    return _hypothesis_line(config)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    # Again at the end: `make test` runs with -q, which hides the header.
    terminalreporter.write_line(_hypothesis_line(config))


@pytest.fixture(autouse=True)
def _pil_bomb_limit_restored():
    """The image task sets PIL's process-wide decompression-bomb limit when it loads (one
    task per worker process); a task a test loads in process must not carry its limit into
    the next test (a shuffled run: a 1-megapixel archive's limit refused test_fuzz_inputs'
    2048x2048 images in PIL's own Image.open)."""
    from PIL import Image

    before = Image.MAX_IMAGE_PIXELS
    yield
    Image.MAX_IMAGE_PIXELS = before


@pytest.fixture(scope="session", autouse=True)
def _background_stops():
    """Servers that fixtures stop in the background (serving_support.stop_in_background,
    ~2.5 s each off the tests' path) are all joined here, at the end of the session:
    a stop that raised or left a process fails the run (an error at teardown).
    Autouse and session-scoped, so set up before and torn down after every fixture
    that may hand it a server."""
    with background_stops_joined():
        yield


@pytest.fixture(scope="session", autouse=True)
def session_slot_dir():
    """PACKRAT_SLOT_DIR for this session: a fresh directory, not the machine-wide one,
    so no stale lock or status file of an earlier run is seen and parallel runs
    do not meet; removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="packrat-test-slots-"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PACKRAT_SLOT_DIR", str(path))
        yield path
    shutil.rmtree(path, ignore_errors=True)


def _build_tiny_store(store: Path) -> Path:
    from packrat.archive import ArchiveOptions, build_from_dir, build_named
    from packrat.archive.local_tokenizers import minilm_dir

    build_named("noop", store)
    build_named("tiny-bert", store)
    build_named("tiny-bert", store, "tiny-bert-ts", ArchiveOptions(runtime="torchscript"))
    # Batching archive for mixed good/bad batches: up to 4 requests, wait 300 ms.
    build_named("tiny-bert", store, "tiny-bert-b4",
                ArchiveOptions(batch_size=4, max_batch_delay_ms=300))
    build_named("tiny-gpt2", store, "tiny-gpt2",
                ArchiveOptions(batch_size=4, max_batch_delay_ms=300, max_new_tokens_cap=12))
    build_named("tiny-resnet", store, "tiny-resnet-ts", ArchiveOptions(runtime="torchscript"))
    # Small image limits so each oversized case needs only a small PNG
    # (test_input_bounds.py; the resized-pixel limit binds below the aspect limit).
    build_named("tiny-resnet", store, "tiny-resnet",
                ArchiveOptions(batch_size=4, max_batch_delay_ms=300,
                               extra={"max_image_pixels": 1_000_000, "max_image_bytes": 200_000,
                                      "max_resized_pixels": 500_000}))
    build_from_dir(minilm_dir(), store, "minilm")
    return store


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_tiny_store(tmp_path_factory.mktemp("model-store"))


@pytest.fixture(scope="session")
def torchserve(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory):
    # One server for every serving module: a JVM start and each worker's torch
    # import cost seconds of CPU on 2 cores; tests only add models and requests.
    server: RunningServer = start_server(tiny_store, tmp_path_factory.mktemp("torchserve"))
    try:
        yield server
    finally:
        stop_in_background(server)  # nothing uses it again; joined by _background_stops
