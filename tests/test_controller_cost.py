"""The controller's upkeep stays small as it runs (issues 31 and 35): a status reads the
tail of swaps.jsonl, not the whole file; the file rotates at a size; the policy's state
is written only when it changed; TorchServe's metrics are scraped once per tick whatever
the number of models; finished jobs are bounded in number and age.

Nothing here times anything: the checks count lines parsed, scrapes and writes (file
inode and mtime), so a busy machine cannot fail them.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import requests

from packrat.control import Controller, ControllerSettings
from packrat.control.history import HISTORY_FILE, KEEP_LINES, TAIL_BYTES, History
from packrat.control.statefiles import POLICY_STATE_FILE, StateFiles
from packrat.jobs import Jobs
from packrat.observe.loop import AdaptiveLoop, adapt_settings
from packrat.bench.adapt_rig import remove_model
from packrat.server import RunningServer
from bench_support import archives_left, no_models_left, shared_torchserve  # noqa: F401 (a fixture)
from reliability_support import copy_sleep_model
from serving_support import usable_cores

PAD = "x" * 700  # a real record carries phases, plans and errors: ~0.5-1 kB a line


def _record(i: int) -> dict:
    return {"model": f"m{i % 5}", "i": i, "outcome": "ok", "pad": PAD}


def _write_lines(path: Path, n: int) -> list[dict]:
    recs = [_record(i) for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def test_a_status_reads_the_tail_of_a_10000_line_history(tmp_path: Path) -> None:
    recs = _write_lines(tmp_path / HISTORY_FILE, 10_000)
    size = (tmp_path / HISTORY_FILE).stat().st_size
    assert size > 1.5 * TAIL_BYTES  # the file is larger than what a first read parses
    h = History(tmp_path)
    last = h.read("m3", last=10)
    assert last == [r for r in recs if r["model"] == "m3"][-10:]  # what the whole file says
    per_line = size / 10_000
    assert h.lines_parsed <= TAIL_BYTES / per_line + 1  # only the tail was parsed
    first = h.lines_parsed
    for _ in range(50):  # the status page polling: nothing appended, nothing parsed
        assert h.read("m3", last=10) == last
    assert h.lines_parsed == first
    h.append(_record(10_003))  # m3 again
    assert h.read("m3", last=10)[-1]["i"] == 10_003
    assert h.lines_parsed == first + 1  # the new line only
    assert len(h.read(None, last=100_000)) == KEEP_LINES  # what is held in memory is bounded


def test_a_half_written_line_waits_and_a_cut_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / HISTORY_FILE
    path.write_text(json.dumps(_record(0)) + "\n" + '{"model": "m1", "cut sho' + "\n")
    h = History(tmp_path)
    assert [r["i"] for r in h.read(None)] == [0]
    with open(path, "a") as f:
        f.write('{"model": "m2", "i": 2')  # being written: not read yet
    assert [r["i"] for r in h.read(None)] == [0]
    with open(path, "a") as f:
        f.write("}\n")
    assert [r["i"] for r in h.read(None)] == [0, 2]


def test_the_history_rotates_at_a_size_and_a_restart_reads_both(tmp_path: Path) -> None:
    h = History(tmp_path, rotate_bytes=20_000)
    for i in range(100):  # ~72 kB in all
        h.append(_record(i))
    path, old = tmp_path / HISTORY_FILE, tmp_path / (HISTORY_FILE + ".1")
    assert path.stat().st_size < 20_000 + 1000 and old.exists() and old.stat().st_size < 20_000 + 1000
    assert [r["i"] for r in h.read(None, last=30)] == list(range(70, 100))  # across the rotation
    again = History(tmp_path)  # a restarted controller: the tail of swaps.jsonl.1, then swaps.jsonl
    got = [r["i"] for r in again.read(None, last=1000)]
    assert got == sorted(got) and got[-1] == 99 and len(got) > path.stat().st_size // 760


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def test_policy_state_is_written_only_when_it_changed(tmp_path: Path) -> None:
    files = StateFiles(tmp_path)
    path = tmp_path / POLICY_STATE_FILE
    state = {"a": {"enabled": True, "estimator": {"samples": [1]}}}
    assert files.save_policy_state(state, ("estimator",))
    stamp = _stamp(path)
    for _ in range(5):  # unchanged: no write
        assert not files.save_policy_state(json.loads(json.dumps(state)), ("estimator",))
    assert _stamp(path) == stamp
    # only the estimator moved: kept in memory, the file waits (at most POLICY_STATE_QUIET_S)
    state["a"]["estimator"]["samples"].append(2)
    assert not files.save_policy_state(state, ("estimator",))
    assert _stamp(path) == stamp and files.policy_state() is state
    assert files.flush_policy_state(("estimator",))  # a clean stop writes it
    assert json.loads(path.read_text()) == state
    stamp = _stamp(path)
    quiet = ("estimator", "policy.correction")
    state["a"]["policy"] = {"swaps": 0, "correction": {"base": 1.0}}
    assert files.save_policy_state(state, quiet)  # a new decision's part
    stamp = _stamp(path)
    state["a"]["policy"]["correction"]["base"] = 1.2  # a key inside a key: quiet too
    assert not files.save_policy_state(state, quiet) and _stamp(path) == stamp
    state["a"]["enabled"] = False  # a decision's part: written at once
    assert files.save_policy_state(state, ("estimator",))
    assert json.loads(path.read_text())["a"]["enabled"] is False and _stamp(path) != stamp
    assert StateFiles(tmp_path).policy_state() == state  # a restart resumes from the file


def test_finished_jobs_are_bounded_in_number_and_age() -> None:
    now = [1000.0]
    jobs = Jobs(keep=3, ttl_s=60.0, clock=lambda: now[0])
    done = threading.Event()
    started = []
    for i in range(8):
        now[0] += 1.0
        j = jobs.start("profile", f"m{i}", lambda: {"ok": True})
        started.append(j.id)
        while jobs.get(j.id) is not None and jobs.get(j.id).state != "done":
            time.sleep(0.01)
    kept = [j.id for j in jobs.recent(last=100)]
    assert kept == started[-3:]  # the newest three finished of the kind
    blocker = jobs.start("tune", "m0", lambda: done.wait(60) and {})  # unfinished: never dropped
    now[0] += 3600.0
    assert [j.id for j in jobs.recent(last=100)] == [blocker.id]  # the old finished ones aged out
    done.set()


@pytest.mark.torchserve
@pytest.mark.slow
def test_ticks_over_five_models_scrape_once_and_leave_unchanged_state_unwritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_torchserve: RunningServer) -> None:
    # On the TorchServe the bench modules share (bench_support), empty before and after.
    server = shared_torchserve
    store = server.model_store
    models = [f"m{i}" for i in range(5)]
    try:
        for m in models:
            copy_sleep_model(store, m)
            server.register(m, 1)
        monkeypatch.setenv("PACKRAT_SLOT_DIR", str(server.slot_dir))
        decided: list[str] = []  # the real re-plan loop; one decision line per model and tick
        policy = AdaptiveLoop(adapt_settings(), emit=decided.append)
        settings = ControllerSettings(management_url=server.management_url, key_file=server.key_file,
                                      metrics_url=server.metrics_url, model_store=store,
                                      state_dir=tmp_path / "state", cores=usable_cores(2), tick_s=0.05)
        c = Controller(settings, policy=policy)
        described: list[str] = []
        describe = c.client.describe_model

        def counted(model: str, version: str | None = None):  # the real call, counted
            described.append(model)
            return describe(model, version)

        monkeypatch.setattr(c.client, "describe_model", counted)
        c.tick()
        path = tmp_path / "state" / POLICY_STATE_FILE
        assert set(json.loads(path.read_text())) == set(models)
        stamp, scrapes = _stamp(path), c.observer.scrapes
        for _ in range(3):
            c.tick()
        assert len(decided) == 4 * len(models), decided
        assert _stamp(path) == stamp  # nothing changed: not written again
        assert c.observer.scrapes - scrapes == 3  # one scrape per tick, not one per model
        assert sorted(described) == models  # idle models: described on the first tick only
        requests.post(f"{server.inference_url}/predictions/m2", data=b"x", headers=server.inference_headers(),
                      timeout=60).raise_for_status()
        c.tick()  # m2 served a request: read again, the others are kept
        assert sorted(described) == sorted(models + ["m2"])
        # The restart watch trusts TorchServe's list of models for each default version's URL
        # (no describe /all per model per tick): the list names the default's directory.
        listed = {m["modelName"]: m["modelUrl"] for m in c.client.list_models()}
        assert listed == {m: describe(m).url for m in models}
    finally:
        for m in models:
            remove_model(server, store, m)
    assert no_models_left(server) == [] and archives_left(server) == []
