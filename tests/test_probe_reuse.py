"""A tune reuses the last tune's capability probe (a child interpreter importing torch and the
runtimes: ~6.5 s on 2 cores) only while the archive, the machine and the probed libraries are
the same; anything else probes again. The real probe reports the versions the controller
compares, so the reuse happens in practice, not only in this file's records."""

from __future__ import annotations

from pathlib import Path

import pytest

from packrat.modes import library_versions
from packrat.profile.probe import PROBED_LIBRARIES, Capabilities, probe_archive
from packrat.tune import run as tune_run
from packrat.types import TuneRecord

KEY = {"base": "m", "model_id": "abc", "machine": {"cpu_model": "cpu", "usable_cores": 2}}


def _caps(**libraries: str | None) -> dict:
    return Capabilities(task="text-classification", mode="fp32-eager", runtimes=("eager", "openvino"),
                        bf16="no bf16 here", unavailable={"ipex": "not installed"}, int8=None,
                        libraries={**library_versions(PROBED_LIBRARIES), **libraries}).to_dict()


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The archives probed afresh (each answers a probe that says "fresh")."""
    seen: list[Path] = []

    def probe(archive_dir, timeout_s: float = 180.0) -> Capabilities:
        seen.append(Path(archive_dir))
        return Capabilities(task="fresh", mode="fp32-eager", runtimes=("eager",), bf16=None,
                            libraries=library_versions(PROBED_LIBRARIES))

    monkeypatch.setattr(tune_run, "probe_archive", probe)
    return seen


def test_the_last_tunes_probe_is_reused_for_the_same_archive_machine_and_libraries(probes, tmp_path) -> None:
    record = TuneRecord(model="m", state="done", key=KEY, capabilities=_caps())
    caps, reused = tune_run.capabilities_for(record, dict(KEY), tmp_path)
    assert reused and probes == []
    assert caps.to_dict() == record.capabilities  # every field back, the libraries too


@pytest.mark.parametrize("why", ["no record", "no key asked", "another archive", "another machine",
                                 "a runtime installed since", "a library upgraded since", "an older record",
                                 "the probe had failed"])
def test_anything_else_probes_again(probes, tmp_path, why: str) -> None:
    record: TuneRecord | None = TuneRecord(model="m", state="done", key=KEY, capabilities=_caps())
    key: dict | None = dict(KEY)
    if why == "no record":
        record = None
    elif why == "no key asked":
        key = None
    elif why == "another archive":
        key = {**KEY, "model_id": "def"}
    elif why == "another machine":
        key = {**KEY, "machine": {**KEY["machine"], "cpu_model": "another cpu"}}
    elif why == "a runtime installed since":  # the record says it was missing; it is installed now
        record = TuneRecord(model="m", state="done", key=KEY, capabilities=_caps(torch=None))
    elif why == "a library upgraded since":
        record = TuneRecord(model="m", state="done", key=KEY, capabilities=_caps(onnx="0.0.1"))
    elif why == "an older record":  # written before probes recorded their libraries
        old = {k: v for k, v in _caps().items() if k != "libraries"}
        record = TuneRecord(model="m", state="done", key=KEY, capabilities=old)
    elif why == "the probe had failed":
        record = TuneRecord(model="m", state="failed", key=KEY, capabilities=None)
    caps, reused = tune_run.capabilities_for(record, key, tmp_path)
    assert not reused and caps.task == "fresh" and probes == [tmp_path], why


def test_the_real_probe_reports_the_libraries_the_controller_compares(tiny_store: Path) -> None:
    caps = probe_archive(tiny_store / "noop")  # a child interpreter, as a tune runs it
    assert set(caps.libraries) == set(PROBED_LIBRARIES)
    assert caps.libraries == library_versions(PROBED_LIBRARIES) and caps.libraries["torch"]  # so a later tune reuses it
    record = TuneRecord(model="noop", state="done", key=KEY, capabilities=caps.to_dict())
    again, reused = tune_run.capabilities_for(record, dict(KEY), tiny_store / "noop")
    assert reused and again == caps
