"""What a new worker imports: one that serves an ONNX Runtime / OpenVINO mode from the
build cache reads its tokenizer and labels without transformers (handlers/packrat_tasks/
tokenizer.py, base.model_labels), and gets the same ids, labels and answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from packrat.archive import build_named
from packrat.archive.builder import HANDLER_DIR

TEXTS = [
    "The film was a delight.", "  leading and trailing spaces  ", "Ünïcödé, accents: café naïve résumé",
    "emoji 🙂 and CJK 漢字 and a very-long-hyphenated-compound-word", "UPPER lower MiXeD 12345 3.14",
    "a" * 300, "tabs\tand\nnew lines", "[CLS] [SEP] [PAD] [MASK] as plain text",
]


@pytest.mark.parametrize("name", ["tiny-bert", "minilm"])
def test_the_fast_tokenizer_gives_what_transformers_gives(tiny_store: Path, name: str) -> None:
    import transformers
    from packrat_tasks.tokenizer import FastTokenizer

    path = str(tiny_store / name / "model")
    ours, theirs = FastTokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert ours(text).input_ids == theirs(text, add_special_tokens=True).input_ids, text
        assert ours(text, add_special_tokens=False).input_ids == theirs(text, add_special_tokens=False).input_ids
    assert (ours.cls_token_id, ours.pad_token_id) == (theirs.cls_token_id, theirs.pad_token_id)
    assert ours.pad_token_id is not None


def test_labels_read_from_config_json_are_transformers_labels(tiny_store: Path) -> None:
    import transformers
    from packrat_tasks.base import model_labels

    for name in ("tiny-bert", "tiny-resnet"):
        path = str(tiny_store / name / "model")
        assert model_labels(path) == dict(transformers.AutoConfig.from_pretrained(path).id2label)


# A fresh interpreter loads the task the way a TorchServe worker does and reports what it imported.
_WORKER = """
import json, sys, yaml
sys.path.insert(0, {handlers!r})
import packrat_handler
config = yaml.safe_load(open({archive!r} + "/model_config.yaml"))
config["packrat"].update(precision="fp32", runtime="openvino")
task = packrat_handler.load_task({archive!r}, config)
answer = task.run(task.sample_requests(1))[0]
print(json.dumps({{"transformers": "transformers" in sys.modules, "cache": task.runner.info.get("build_cache"),
                  "answer": answer}}))
"""


def _worker(archive: Path) -> dict:
    code = _WORKER.format(handlers=str(HANDLER_DIR), archive=str(archive))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["tiny-bert", "tiny-resnet"])
def test_a_worker_served_from_the_build_cache_never_imports_transformers(tmp_path: Path, arch: str) -> None:
    pytest.importorskip("openvino")
    archive = build_named(arch, tmp_path, arch)
    first = _worker(archive)  # builds the export (needs the model, so transformers) and the verdict
    assert first["transformers"] and first["cache"]["onnx"] == "built"
    again = _worker(archive)
    assert again["cache"]["onnx"] == "hit" and again["cache"]["guard"] == "hit"
    assert not again["transformers"]
    assert again["answer"] == first["answer"]
