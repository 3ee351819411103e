"""Archive builder: deterministic content, layout TorchServe accepts, honest errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from packrat.archive import ArchiveOptions, build_from_dir, build_named, handler_is_current
from packrat.archive.local_tokenizers import gpt2_tokenizer, minilm_dir
from packrat.errors import ArchiveError
from packrat.profile.identity import content_hash


def test_same_spec_gives_same_content_hash(tmp_path) -> None:
    a = build_named("tiny-gpt2", tmp_path / "a")
    b = build_named("tiny-gpt2", tmp_path / "b")
    assert content_hash(a) == content_hash(b)
    c = build_named("tiny-gpt2", tmp_path / "c", options=ArchiveOptions(seed=1))
    assert content_hash(c) != content_hash(a)  # other weights, other id


def test_layout_manifest_and_config(tmp_path) -> None:
    path = build_named("tiny-bert", tmp_path, "clf", ArchiveOptions(
        runtime="torchscript", batch_size=8, max_batch_delay_ms=20, max_length=32, version="7"))
    manifest = json.loads((path / "MAR-INF" / "MANIFEST.json").read_text())
    assert manifest["model"] == {"modelName": "clf", "modelVersion": "7",
                                 "handler": "packrat_handler.py", "configFile": "model_config.yaml"}
    config = yaml.safe_load((path / "model_config.yaml").read_text())
    assert (config["batchSize"], config["maxBatchDelay"]) == (8, 20)
    assert config["packrat"]["task"] == "text-classification"
    assert config["packrat"]["runtime"] == "torchscript"
    assert config["packrat"]["max_length"] == 32
    assert (path / "packrat_handler.py").is_file()
    assert (path / "packrat_tasks" / "text.py").is_file()
    assert (path / "model" / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".*building*"))


def test_minilm_dir_keeps_real_weights(tmp_path) -> None:
    path = build_from_dir(minilm_dir(), tmp_path, "minilm")
    config = yaml.safe_load((path / "model_config.yaml").read_text())
    assert config["packrat"]["task"] == "feature-extraction"  # inferred from BertModel
    assert config["packrat"]["max_length"] == 256  # sentence_bert_config.json
    assert (path / "model" / "model.safetensors").read_bytes() == \
        (minilm_dir() / "model.safetensors").read_bytes()


def test_minilm_builds_by_name_as_the_cli_lists_it(tmp_path) -> None:
    # build_named's error lists minilm among the known names; the bench builds by name.
    path = build_named("minilm", tmp_path, options=ArchiveOptions(max_length=32))
    config = yaml.safe_load((path / "model_config.yaml").read_text())
    assert path.name == "minilm" and config["packrat"]["task"] == "feature-extraction"
    assert config["packrat"]["max_length"] == 32
    assert (path / "model" / "model.safetensors").read_bytes() == \
        (minilm_dir() / "model.safetensors").read_bytes()


@pytest.mark.parametrize("call,message", [
    (lambda s: build_named("gpt3", s), "unknown architecture"),
    (lambda s: build_named("tiny-gpt2", s, options=ArchiveOptions(runtime="torchscript")), "eager only"),
    (lambda s: build_named("tiny-resnet", s, options=ArchiveOptions(task="text-generation")), "supports tasks"),
    (lambda s: build_named("tiny-bert", s, "bad/name"), "must match"),
    (lambda s: build_named("tiny-bert", s, options=ArchiveOptions(batch_size=0)), "--batch-size"),
    (lambda s: build_from_dir(s, s, "x"), "no config.json"),
])
def test_errors_are_archive_errors(tmp_path, call, message) -> None:
    with pytest.raises(ArchiveError, match=message):
        call(tmp_path)


def test_existing_archive_needs_force(tmp_path) -> None:
    build_named("noop", tmp_path)
    with pytest.raises(ArchiveError, match="already exists"):
        build_named("noop", tmp_path)
    build_named("noop", tmp_path, force=True)


def test_gpt2_tokenizer_has_model_vocab_size_and_round_trips() -> None:
    tok = gpt2_tokenizer(50257, 1024)
    assert len(tok) == 50257 and tok.eos_token_id == 50256
    text = "Packrat serves GPT-2 on CPUs, naïvely? No: carefully!"
    assert tok.decode(tok(text).input_ids) == text  # byte-level: lossless


def test_handler_is_current_tells_a_stale_handler_copy(tmp_path: Path) -> None:
    """Benchmarks reuse built archives only while they hold this checkout's handler."""
    archive = build_named("tiny-bert", tmp_path, "bert")
    assert handler_is_current(archive)
    runtime = archive / "packrat_tasks" / "runtime.py"
    runtime.write_text(runtime.read_text() + "\n# an older copy\n")
    assert not handler_is_current(archive)
    build_named("tiny-bert", tmp_path, "bert", force=True)
    assert handler_is_current(archive)
    (archive / "packrat_tasks" / "extra.py").write_text("")
    assert not handler_is_current(archive)


def test_reuse_current_keeps_a_current_archive_and_rebuilds_a_stale_one(tmp_path: Path) -> None:
    archive = build_named("tiny-bert", tmp_path, "bert")
    weights = archive / "model" / "model.safetensors"
    before = weights.stat().st_ino
    assert build_named("tiny-bert", tmp_path, "bert", reuse_current=True) == archive
    assert weights.stat().st_ino == before  # kept, not rebuilt
    runtime = archive / "packrat_tasks" / "runtime.py"
    runtime.write_text(runtime.read_text() + "\n# an older copy\n")
    build_named("tiny-bert", tmp_path, "bert", reuse_current=True)
    assert handler_is_current(archive) and weights.stat().st_ino != before  # rebuilt
    with pytest.raises(ArchiveError, match="already exists"):
        build_named("tiny-bert", tmp_path, "bert")  # neither force nor reuse: refused as before
