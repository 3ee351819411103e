"""Shared fixtures: tiny archives built once per session, real TorchServe per module.

`tiny_store` builds every tiny archive into one temporary model store (seeded
weights, local tokenizers, ~30 s). `torchserve` starts one TorchServe on free
loopback ports for the session, token authorisation on, and stops it — also
when tests fail; modules register the archives they need (ensure_registered).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from packrat.server import RunningServer, start_torchserve


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
    # A small pixel limit so the oversized-image case needs only a small PNG.
    build_named("tiny-resnet", store, "tiny-resnet",
                ArchiveOptions(batch_size=4, max_batch_delay_ms=300,
                               extra={"max_image_pixels": 1_000_000}))
    build_from_dir(minilm_dir(), store, "minilm")
    return store


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_tiny_store(tmp_path_factory.mktemp("model-store"))


@pytest.fixture(scope="session")
def torchserve(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory):
    # One server for every serving module: a JVM start and each worker's torch
    # import cost seconds of CPU on 2 cores; tests only add models and requests.
    server: RunningServer = start_torchserve(tiny_store, tmp_path_factory.mktemp("torchserve"))
    try:
        yield server
    finally:
        server.stop()
