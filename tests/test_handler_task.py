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


@pytest.mark.parametrize("name", ["tiny-bert", "minilm"])
def test_texts_of_mixed_lengths_are_padded_and_masked_and_answer_as_alone(tiny_store, name) -> None:
    import torch

    task = load(tiny_store / name)
    texts = ["short", "a somewhat longer text than the first one", "", "mid length text"]
    batch = task.preprocess([{"body": t.encode()} for t in texts])
    assert batch.valid == [0, 1, 3] and 2 in batch.errors  # the empty text fails alone
    ids, mask = batch.inputs["input_ids"], batch.inputs["attention_mask"]
    assert ids.dtype == mask.dtype == torch.long
    rows = [task.tokenizer(t, add_special_tokens=True).input_ids for t in (texts[0], texts[1], texts[3])]
    length = max(map(len, rows))
    assert tuple(ids.shape) == tuple(mask.shape) == (3, length)
    pad = task.tokenizer.pad_token_id or 0
    for r, row in enumerate(rows):
        assert ids[r].tolist() == row + [pad] * (length - len(row))
        assert mask[r].tolist() == [1] * len(row) + [0] * (length - len(row))
    together = task.run([{"body": t.encode()} for t in texts])
    for i in (0, 1, 3):
        alone = task.run([{"body": texts[i].encode()}])[0]
        assert _numbers(together[i]) == pytest.approx(_numbers(alone), abs=1e-5)


def _numbers(answer: dict) -> list[float]:
    """Every number of a text task's answer (scores or an embedding), in order."""
    values = answer.get("embedding") or list(answer["scores"].values())
    return [float(v) for v in values]


def test_all_bad_batch_skips_the_model(tiny_store) -> None:
    task = load(tiny_store / "tiny-bert")
    out = task.run([{"body": b""}, {"body": b"\xff"}])
    assert [r.status for r in out] == [400, 400]


@pytest.mark.parametrize("size", [(320, 240), (240, 320), (1000, 667), (200, 150), (257, 256), (4000, 300)])
def test_one_step_resize_and_crop_matches_the_standard_two_step_transform(size) -> None:
    """to_pixels resizes only the box the centre crop keeps; it must give what
    resize(shorter side 256) + centre crop(224) gives, to within 8-bit rounding."""
    import io

    import numpy as np
    from PIL import Image

    from packrat_tasks.image import CROP, MEAN, STD, resized_size, to_pixels
    from packrat_tasks.samples import sample_jpeg

    img = Image.open(io.BytesIO(sample_jpeg(*size, seed=7)))
    two_step = img.convert("RGB").resize(resized_size(*img.size), Image.Resampling.BILINEAR)
    w, h = two_step.size
    left, top = (w - CROP) // 2, (h - CROP) // 2
    two_step = np.asarray(two_step.crop((left, top, left + CROP, top + CROP)), dtype=np.float32)
    levels = (to_pixels(img).transpose(1, 2, 0) * STD + MEAN) * 255.0 - two_step
    pixels = to_pixels(img)
    assert pixels.shape == (3, CROP, CROP) and pixels.dtype == np.float32 and pixels.flags["C_CONTIGUOUS"]
    assert np.abs(levels).max() <= 1.01, np.abs(levels).max()  # one 8-bit level at most
    assert np.abs(levels).mean() < 0.3  # rounding: PIL's two passes round at other points
