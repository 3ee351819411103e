"""Version directories: links not copies, the plan in model_config.yaml, a new MANIFEST version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from packrat.apply import versions
from packrat.slots import parse_cpu_list
from packrat.errors import ConfigError
from packrat.slots import parse_slots
from packrat.types import Instance, Plan


@pytest.fixture
def store(tmp_path: Path) -> Path:
    base = tmp_path / "m"
    (base / "MAR-INF").mkdir(parents=True)
    (base / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(
        {"runtime": "python", "model": {"modelName": "m", "modelVersion": "1.0",
                                        "handler": "packrat_handler.py", "configFile": "model_config.yaml"}}))
    (base / "model_config.yaml").write_text(yaml.safe_dump(
        {"minWorkers": 1, "maxWorkers": 1, "batchSize": 1, "responseTimeout": 77, "packrat": {"task": "noop"}}))
    (base / "weights.safetensors").write_bytes(b"\0" * 4096)
    (base / "packrat_handler.py").write_text("# handler\n")
    (base / "tokenizer").mkdir()
    (base / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    return tmp_path


def test_version_dir_links_base_files_and_carries_the_plan(store: Path) -> None:
    plan = Plan(cores=2, batch=4, instances=(Instance(1, 2, 3.0), Instance(1, 2, 3.0)), predicted_latency_ms=3.0)
    v = versions.create_version(store, "m", "m", plan, [0, 1])
    assert v.version == "p1" and v.path == store / "m.p1" and v.url == "m.p1"
    for name in ("weights.safetensors", "packrat_handler.py", "tokenizer"):
        link = v.path / name
        assert link.is_symlink()  # a link, never a copy
        assert link.resolve() == (store / "m" / name).resolve()
    assert (v.path / "tokenizer" / "vocab.txt").read_text() == "a\nb\n"
    manifest = json.loads((v.path / "MAR-INF" / "MANIFEST.json").read_text())
    assert manifest["model"]["modelVersion"] == "p1"
    assert manifest["model"]["handler"] == "packrat_handler.py"
    cfg = yaml.safe_load((v.path / "model_config.yaml").read_text())
    assert (cfg["batchSize"], cfg["minWorkers"], cfg["maxWorkers"]) == (2, 2, 2)
    assert cfg["responseTimeout"] == 77  # the base's other settings are kept
    assert cfg["packrat"]["task"] == "noop"  # and the base's own packrat keys
    assert cfg["packrat"]["slots"] == [{"cores": [0], "threads": 1}, {"cores": [1], "threads": 1}]
    assert [(c, t) for c, t in parse_slots(cfg["packrat"])] == [((0,), 1), ((1,), 1)]
    back = versions.load_version(v.path)
    assert back is not None and back.plan == plan and back.plan_id == v.plan_id and back.base == "m"
    # The next version of the same model gets the next number; the base is no Packrat version.
    assert versions.create_version(store, "m", "m", plan, [0, 1]).version == "p2"
    assert versions.load_version(store / "m") is None
    versions.remove_version(v.path)
    assert not v.path.exists()
    assert (store / "m" / "weights.safetensors").stat().st_size == 4096  # base untouched


@pytest.mark.parametrize("cap,latency_ms,want", [
    (1, 400.0, versions.DEFAULT_MAX_BATCH_DELAY_MS),  # a batch of one is full at once
    (4, 20.0, versions.DEFAULT_MAX_BATCH_DELAY_MS),  # a tenth of 20 ms is under the floor
    (4, 270.0, 27),  # a tenth of the batch's predicted latency
    (32, 2035.0, versions.MAX_BATCH_DELAY_CAP_MS),  # capped
    (8, 0.0, versions.DEFAULT_MAX_BATCH_DELAY_MS),  # no prediction
])
def test_batch_delay_is_a_tenth_of_the_predicted_batch_latency(cap: int, latency_ms: float, want: int) -> None:
    plan = Plan(cores=2, batch=2 * cap, instances=(Instance(1, cap, latency_ms),) * 2, predicted_latency_ms=latency_ms)
    assert versions.batch_delay_ms(plan) == want


def test_version_config_carries_the_derived_batch_delay_unless_one_is_given(store: Path) -> None:
    plan = Plan(cores=2, batch=8, instances=(Instance(1, 4, 300.0),) * 2, predicted_latency_ms=300.0)
    derived = versions.create_version(store, "m", "m", plan, [0, 1])
    assert yaml.safe_load((derived.path / "model_config.yaml").read_text())["maxBatchDelay"] == 30
    assert versions.load_version(derived.path).max_batch_delay_ms == 30
    given = versions.create_version(store, "m", "m", plan, [0, 1], max_batch_delay_ms=7)
    assert yaml.safe_load((given.path / "model_config.yaml").read_text())["maxBatchDelay"] == 7


def test_heterogeneous_layout_widest_first() -> None:
    plan = Plan(cores=4, batch=6, instances=(Instance(1, 2, 1.0), Instance(2, 2, 1.0), Instance(1, 2, 1.0)),
                predicted_latency_ms=1.0)
    slots = versions.assign_cores(plan, [4, 5, 6, 7])
    assert [(s.cores, s.threads) for s in slots] == [((4, 5), 2), ((6,), 1), ((7,), 1)]


@pytest.mark.parametrize("instances, cores, why", [
    ((Instance(3, 1, 1.0),), 2, "threads"),
    ((Instance(1, 1, 1.0),) * 3, 2, "threads"),
    ((Instance(1, 0, 1.0),), 2, "batch"),
    ((Instance(0, 1, 1.0),), 2, "threads"),
    ((), 2, "instance"),
])
def test_invalid_plans_are_rejected_before_anything_is_written(store: Path, instances, cores, why) -> None:
    plan = Plan(cores=2, batch=1, instances=instances, predicted_latency_ms=1.0)
    with pytest.raises(ConfigError, match=why):
        versions.create_version(store, "m", "m", plan, list(range(cores)))
    assert sorted(p.name for p in store.iterdir()) == ["m"]


def test_mixed_batch_caps_are_not_one_version(store: Path) -> None:
    plan = Plan(cores=2, batch=3, instances=(Instance(1, 2, 1.0), Instance(1, 1, 1.0)), predicted_latency_ms=1.0)
    with pytest.raises(ConfigError, match="batch cap"):
        versions.create_version(store, "m", "m", plan, [0, 1])


def test_cpu_list_parsing() -> None:
    assert parse_cpu_list("0-2,5\n") == (0, 1, 2, 5)
    assert parse_cpu_list("3") == (3,)
