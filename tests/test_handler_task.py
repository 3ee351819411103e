"""The handler's Task interface outside TorchServe (what the profiler uses)."""

from __future__ import annotations

import importlib
import sys

import pytest
import yaml


def load(archive):
    """Import the archive's own packrat_handler (fresh: each archive has its own copy).

    The modules imported before are put back afterwards: other test modules hold
    the handlers/ copy (and its runtime registry) from their own imports.
    """

    def ours(module_name: str) -> bool:
        return module_name.split(".")[0] in ("packrat_handler", "packrat_tasks")

    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(archive))
    try:
        handler = importlib.import_module("packrat_handler")
        config = yaml.safe_load((archive / "model_config.yaml").read_text())
        return handler.load_task(str(archive), config)
    finally:
        sys.path.remove(str(archive))
        for name in [m for m in sys.modules if ours(m)]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.mark.parametrize("name", ["noop", "tiny-bert", "tiny-bert-ts", "tiny-gpt2", "tiny-resnet", "minilm"])
def test_run_equals_the_three_stages_and_sample_requests_are_valid(tiny_store, name) -> None:
    task = load(tiny_store / name)
    requests = task.sample_requests(3)
    assert len(requests) == 3 and all(isinstance(r["body"], bytes) for r in requests)
    staged = task.postprocess(task.forward(task.preprocess(requests)))
    whole = task.run(requests)
    assert len(whole) == 3
    assert not any(getattr(r, "status", 200) != 200 for r in whole), whole
    assert staged == whole


def test_sample_text_has_the_full_sequence_length(tiny_store) -> None:
    task = load(tiny_store / "tiny-bert")
    batch = task.preprocess(task.sample_requests(2))
    # max_length tokens (minus at most one word's split) -> realistic seq len for profiling
    assert task.max_length - 3 <= batch.inputs["input_ids"].shape[1] <= task.max_length


def test_all_bad_batch_skips_the_model(tiny_store) -> None:
    task = load(tiny_store / "tiny-bert")
    out = task.run([{"body": b""}, {"body": b"\xff"}])
    assert [r.status for r in out] == [400, 400]
