"""bf16w — the weights themselves in bf16, eager only — for GPT-2's decoding loop (issue 35).

The rules are pure (packrat.modes, packrat.tune.modes); the mode itself is built in
process on a tiny GPT-2 through the handler, as TorchServe's worker builds it, with
the accuracy guard at its defaults. Serving through TorchServe: tests/test_modes_serving.py
(gpt2-bf16w-eager among GEN_MODES). The benchmark's table: packrat.bench.gen_precision.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from packrat import modes
from packrat.archive import ArchiveOptions, build_named
from packrat.errors import ArchiveError
from packrat.modes import ExecutionMode
from packrat.profile.probe import Capabilities
from packrat.tune.modes import SHORTLIST, candidate_modes

NO_BF16 = {"avx2", "avx512f", "avx512_vnni"}  # an AVX-512 CPU without bf16 instructions


def _bf16_here() -> str | None:
    import torch

    mkldnn = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return modes.bf16_problem(modes.cpu_flags(), mkldnn, "bf16w")


# -- the rules ------------------------------------------------------------------------


def test_bf16w_is_a_precision_that_runs_eager_only() -> None:
    assert "bf16w" in modes.PRECISIONS and "bf16w-eager" in modes.every_mode()
    assert ExecutionMode.parse("BF16W-Eager") == ExecutionMode("bf16w", "eager")
    assert modes.pairing_refusal(ExecutionMode("bf16w", "eager")) is None
    for runtime in ("torchscript", "inductor", "onnxruntime", "openvino", "ipex"):
        why = modes.pairing_refusal(ExecutionMode("bf16w", runtime))
        assert why and "eager only" in why, runtime
    # Generation's own rule lets it through: eager is the one runtime it runs.
    assert modes.task_refusal(modes.TEXT_GENERATION, "eager") is None


def test_bf16w_is_refused_with_its_name_where_the_cpu_lacks_bf16() -> None:
    why = modes.bf16_problem(NO_BF16, True, "bf16w")
    assert why.startswith("packrat.precision bf16w needs a CPU with native bf16") and "avx512_bf16" in why
    assert "oneDNN" in modes.bf16_problem({"avx512_bf16"}, False, "bf16w")
    assert modes.bf16_problem({"avx512_bf16"}, True, "bf16w") is None
    assert modes.bf16_problem({"amx_bf16"}, True, "bf16w") is None


def _caps(task: str, bf16: str | None) -> Capabilities:
    return Capabilities(task=task, mode="fp32-eager", runtimes=("eager", "torchscript", "onnxruntime"),
                        bf16=bf16)


def test_generation_shortlist_tries_bf16w_only_with_native_bf16() -> None:
    assert "bf16w-eager" in SHORTLIST["text-generation"]
    tried, skipped = candidate_modes(_caps("text-generation", None))
    assert tried[0] == "fp32-eager" and "bf16w-eager" in tried and "bf16w-eager" not in skipped
    reason = modes.bf16_problem(NO_BF16, True)
    tried, skipped = candidate_modes(_caps("text-generation", reason))
    assert "bf16w-eager" not in tried and skipped["bf16w-eager"] == reason
    # Asked for by name with another runtime: refused with the pairing's reason.
    tried, skipped = candidate_modes(_caps("text-classification", None), ["bf16w-torchscript", "bf16w-eager"])
    assert tried == ["fp32-eager", "bf16w-eager"] and "eager only" in skipped["bf16w-torchscript"]


def test_the_archive_builder_takes_bf16w_with_eager_only(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError, match="eager only"):
        build_named("tiny-bert", tmp_path, "b", ArchiveOptions(precision="bf16w", runtime="torchscript"))
    archive = build_named("tiny-gpt2", tmp_path, "g", ArchiveOptions(precision="bf16w"))
    config = yaml.safe_load((archive / "model_config.yaml").read_text())
    assert (config["packrat"]["precision"], config["packrat"]["runtime"]) == ("bf16w", "eager")


# -- the mode, in process -------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("bf16w-store")
    build_named("tiny-gpt2", store, "gpt2", ArchiveOptions(max_new_tokens_cap=8))
    build_named("tiny-bert", store, "bert")
    return store


def _load(store: Path, name: str, **packrat):
    import packrat_handler  # noqa: F401 - handlers/ is on sys.path (pyproject's pythonpath)

    config = copy.deepcopy(yaml.safe_load((store / name / "model_config.yaml").read_text()))
    config["packrat"].update(packrat)
    return packrat_handler.load_task(str(store / name), config)


@pytest.mark.skipif(_bf16_here() is not None, reason=f"no native bf16 here: {_bf16_here()}")
def test_bf16w_generation_builds_and_passes_the_default_guard(store: Path) -> None:
    import torch

    from packrat_tasks import guard

    task = _load(store, "gpt2", precision="bf16w")
    runner = task.runner
    assert runner.mode == "bf16w-eager" and runner.guard["ok"], runner.guard["message"]
    assert runner.guard["thresholds"] == guard.thresholds({"packrat": {}})  # the defaults, untouched
    assert runner.guard["metrics"]["exact_fraction"] == 1.0 and runner.guard["metrics"]["prompts"] == 8
    # The served model holds bf16 weights; only the layer norms stay fp32.
    dtypes = {name: p.dtype for name, p in task.model.named_parameters()}
    norms = {name for name, m in task.model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    assert norms and all(dtypes[f"{n}.weight"] == torch.float32 for n in norms)
    others = [d for name, d in dtypes.items() if name.rsplit(".", 1)[0] not in norms]
    assert others and set(others) == {torch.bfloat16}
    assert runner.summary()["bf16w"]["fp32_modules"] == f"LayerNorm x{len(norms)}"
    # The served call: the same greedy tokens as fp32 for a prompt the guard did not see.
    fp32 = _load(store, "gpt2")
    body = json.dumps({"text": "A prompt of our own, not one of the guard's", "max_new_tokens": 8}).encode()
    got, ref = (t.run([{"body": body}]) for t in (task, fp32))
    assert got[0]["token_ids"] == ref[0]["token_ids"] and len(ref[0]["token_ids"]) == 8


@pytest.mark.skipif(_bf16_here() is not None, reason=f"no native bf16 here: {_bf16_here()}")
def test_bf16w_encoder_passes_the_guard_and_other_runtimes_are_refused(store: Path) -> None:
    from packrat_tasks.precision import PrecisionError

    task = _load(store, "bert", precision="bf16w")
    assert task.runner.guard["ok"] and task.runner.guard["metrics"]["max_prob_diff"] > 0  # really bf16
    for runtime in ("torchscript", "openvino"):
        with pytest.raises(PrecisionError, match=f"bf16w-{runtime} is not offered: .*eager only"):
            _load(store, "bert", precision="bf16w", runtime=runtime)


# -- the benchmark's table --------------------------------------------------------------


def test_gen_precision_table_reads_the_results_file(tmp_path: Path) -> None:
    from packrat.bench.gen_precision import cpu_s, render

    rows = [{"run": "r", "kind": "machine", "cpu": "Some CPU", "flags": ["avx512_bf16"], "cores": 2,
             "torch": "t", "transformers": "x"},
            {"run": "r", "kind": "mode", "arch": "gpt2", "mode": "fp32-eager"},
            {"run": "r", "kind": "mode", "arch": "gpt2", "mode": "bf16w-eager", "guard": "accuracy guard passed"},
            {"run": "r", "kind": "mode", "arch": "gpt2", "mode": "bf16-eager", "error": "PrecisionError: no"}]
    for rnd, (fp32, bf16w) in enumerate([(1200.0, 600.0), (1000.0, 520.0), (1100.0, 500.0)]):
        for mode, ms in (("fp32-eager", fp32), ("bf16w-eager", bf16w)):
            rows.append({"run": "r", "kind": "call", "arch": "gpt2", "mode": mode, "round": rnd, "wall_ms": ms,
                         "cpu_ms": 2 * ms, "tokens_per_s": 160000 / ms, "load_avg_1m": 1.0})
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = render(path)
    assert "Some CPU (avx512_bf16)" in table
    line = next(ln for ln in table.splitlines() if "| bf16w-eager |" in ln)
    # fp32 / bf16w per round: 2.0, 1.92, 2.2 -> median 2.00 (wall); CPU: 2.0 in every round.
    assert "| passed |" in line and "600.0, 520.0, 500.0" in line and "| 2.00x | 2.00x |" in line
    assert "PrecisionError: no" in next(ln for ln in table.splitlines() if "| bf16-eager |" in ln)
    c0 = cpu_s()
    while cpu_s() - c0 < 0.05:  # busy: /proc/self/stat's utime moves
        pass
    assert cpu_s() > c0
