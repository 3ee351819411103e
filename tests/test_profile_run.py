"""Real profiling runs of a tiny archive: pinned worker processes, the CLI, budgets, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from packrat.plan.confidence import beats_fat, is_fat
from packrat.profile import load_profile, open_archive
from packrat.profile.fingerprint import current_fingerprint
from packrat.slots import parse_cpu_list
from profile_support import make_tiny_archive

CORES = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs 2 usable cores")


# A hang guard only, not a speed target: the profiler's timings are in docs/profiler.md.
def packrat(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "packrat.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@needs_two_cores
def test_real_tiny_archive_profile_t2_b4(tmp_path):
    """The real handler (handlers/) in an archive built by `packrat archive`, profiled at T=2, b<=4."""
    res = packrat("archive", "tiny-bert", "-o", str(tmp_path / "store"))
    assert res.returncode == 0, res.stderr
    archive_path, printed_id = res.stdout.strip().splitlines()[-1].split("\t")
    out = tmp_path / "profile.json"
    started = time.monotonic()
    res = packrat("profile", archive_path, "--cores", "2", "--max-batch", "4",
                  "--point-budget", "0.5", "-o", str(out))
    elapsed = time.monotonic() - started
    assert res.returncode == 0, res.stderr
    print(f"profile T<=2, b<=4: {elapsed:.1f} s")  # ~20 s on an idle 2-core machine

    ref = open_archive(archive_path)
    assert ref.model_id == printed_id  # `packrat archive` and the profiler agree on identity
    profile = load_profile(out, expect_model_id=ref.model_id,
                           expect_fingerprint=current_fingerprint(ref.config))
    assert profile.scope == "handler" and profile.fingerprint.mode == "fp32-eager"
    assert {(p.threads, p.batch) for p in profile.points} == {(t, b) for t in (1, 2) for b in (1, 2, 4)}
    for p in profile.points:
        assert p.mean_ms > 0 and p.count >= 1 and p.p50_ms <= p.p99_ms
        # pinning was applied in the child before torch started its pools:
        # the process and every one of its threads may run on exactly the first t cores
        assert set(parse_cpu_list(p.meta["cpus_allowed_list"])) == set(CORES[: p.threads])
        assert [set(parse_cpu_list(c)) for c in p.meta["thread_cpu_lists"]] == [set(CORES[: p.threads])]
        assert p.meta["torch_threads"] == p.threads and p.meta["interop_threads"] == 1
    # one worker process per thread count, each timing all its batch sizes
    pids = {t: {p.meta["pid"] for p in profile.points if p.threads == t} for t in (1, 2)}
    assert all(len(s) == 1 for s in pids.values()) and pids[1] != pids[2]
    assert os.getpid() not in pids[1] | pids[2]
    data = json.loads(out.read_text())
    assert data["complete"] is True and data["omitted"] == []
    assert "wrote" in res.stdout
    # Every worker was forked warm by the profiler's own fork server, as served workers are.
    assert [w["forked"] for w in data["workers"]] == [True, True]
    # Co-run: 2 instances of 1 thread at once, each on its own core (as each worker read
    # its affinity from the kernel), every batch; the figure is the slower instance's.
    assert data["figures"] == "isolated+co-run"
    assert {(p.instances, p.threads, p.batch) for p in profile.corun} == {(2, 1, b) for b in (1, 2, 4)}
    for p in profile.corun:
        cpus = [set(parse_cpu_list(c)) for c in p.meta["per_instance_cpus"]]
        assert sorted(cpus, key=min) == [{CORES[0]}, {CORES[1]}]
        assert p.mean_ms == max(p.meta["per_instance_mean_ms"]) > 0
    # The optimiser plans 2 x 1 thread from the co-run figure, 1 x 2 threads from the isolated one.
    from packrat.plan import realizable_plan, uniform_plan
    thin = uniform_plan(2, 1, 2, 2, 4, profile)
    assert thin.predicted_latency_ms == profile.instance_latency(1, 2, 2) == \
        next(p.mean_ms for p in profile.corun if p.batch == 2)
    assert realizable_plan(profile, 2, 4).predicted_latency_ms in (
        thin.predicted_latency_ms, profile.latency(2, 4), profile.instance_latency(1, 4, 1))
    # ... and it is the fastest of them (the thin one scored by its co-run figure), unless the
    # noise guard keeps fat: a profile measured on a busy machine may not tell them apart (then
    # the guard's own verdict must say so).
    fastest = min(thin.predicted_latency_ms, profile.latency(2, 4), profile.instance_latency(1, 4, 1))
    chosen = realizable_plan(profile, 2, 4)
    unguarded = realizable_plan(profile, 2, 4, noise_guard=False)
    assert unguarded.predicted_latency_ms == fastest
    assert chosen == unguarded or (is_fat(chosen) and beats_fat(profile, unguarded) is False)
    # the worker wrote no bytecode into the archive (it would not change the id, but it litters)
    assert not list(Path(archive_path).rglob("__pycache__"))


# One profiling run for two checks that need a run each but not a different one (each run
# costs a CLI start, imports and a worker): the forked path is test_real_tiny_archive's.
def test_PACKRAT_FORKSERVER_0_profiles_in_new_interpreters_and_model_scope_is_recorded(tmp_path):
    archive = make_tiny_archive(tmp_path / "tiny")
    out = tmp_path / "p.json"
    res = packrat("profile", str(archive), "--cores", "1", "--max-batch", "2", "--scope", "model",
                  "--point-budget", "0.3", "-q", "-o", str(out), env={**os.environ, "PACKRAT_FORKSERVER": "0"})
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert [w["forked"] for w in data["workers"]] == [False]
    assert sorted((p["threads"], p["batch"]) for p in data["points"]) == [(1, 1), (1, 2)]
    profile = load_profile(out)
    assert profile.scope == "model"
    assert sorted((p.threads, p.batch) for p in profile.points) == [(1, 1), (1, 2)]


# Appended to an archive's handler: each worker records what it had imported when its
# model load began, i.e. what its fork server had imported before forking it.
SEEN_AT_LOAD = """

def _record_then(load):
    def load_task(model_dir, model_yaml_config):
        import json, os, sys
        with open(os.environ["SEEN_AT_LOAD"], "a") as seen:
            seen.write(json.dumps({"pid": os.getpid(), "transformers": "transformers" in sys.modules,
                                   "torch": "torch" in sys.modules}) + "\\n")
        return load(model_dir, model_yaml_config)
    return load_task


load_task = _record_then(load_task)
"""


def test_a_noop_profile_forks_its_worker_from_a_server_that_never_imported_transformers(tmp_path):
    """The profiler's fork server imports what the profiled archive's worker needs: torch for
    every worker, no transformers for noop (the server used to import it, ~4 s of CPU
    before the first fork, for a worker that never needs it)."""
    from packrat.archive import build_named

    archive = build_named("noop", tmp_path / "store")
    handler = archive / "packrat_handler.py"
    handler.write_text(handler.read_text() + SEEN_AT_LOAD)
    seen, out = tmp_path / "seen.jsonl", tmp_path / "p.json"
    res = packrat("profile", str(archive), "--cores", "1", "--max-batch", "1", "--point-budget", "0.3",
                  "-q", "-o", str(out), env={**os.environ, "SEEN_AT_LOAD": str(seen)})
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert [w["forked"] for w in data["workers"]] == [True]
    assert [(p["threads"], p["batch"]) for p in data["points"]] == [(1, 1)]
    (worker,) = [json.loads(line) for line in seen.read_text().splitlines()]
    assert worker["pid"] == data["workers"][0]["pid"]
    assert worker["torch"] is True and worker["transformers"] is False


def test_exhausted_budget_omits_points_and_invents_none(tmp_path):
    archive = make_tiny_archive(tmp_path / "tiny")
    out = tmp_path / "p.json"
    # 0.5 s cannot even cover starting a worker (importing torch): nothing can be measured
    res = packrat("profile", str(archive), "--cores", "1", "--max-batch", "4", "--budget", "0.5",
                  "-q", "-o", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    measured = {(p["threads"], p["batch"]) for p in data["points"]}
    omitted = {(o["threads"], o["batch"]) for o in data["omitted"]}
    assert measured == set() and omitted == {(1, 1), (1, 2), (1, 4)}
    assert all("budget" in o["reason"] for o in data["omitted"])
    assert "3 omitted" in res.stdout


def test_failing_handler_is_one_line_error(tmp_path):
    archive = make_tiny_archive(tmp_path / "tiny")
    src = (archive / "packrat_handler.py").read_text()
    (archive / "packrat_handler.py").write_text(src.replace("def load_task(model_dir, model_yaml_config):",
                                                           "def load_task(model_dir, model_yaml_config):\n    raise ValueError('no weights here')"))
    res = packrat("profile", str(archive), "--cores", "1", "--max-batch", "1", "-o", str(tmp_path / "p.json"))
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert "no weights here" in res.stderr.strip().splitlines()[-1]


def test_a_run_without_a_log_path_keeps_its_scratch_log_only_when_it_fails(tmp_path, monkeypatch):
    """No log path given (the controller's re-profile before, a bench): the workers' output
    went to /tmp/packrat-profile-<pid>.log and stayed there after every run (132 such files
    piled up in 13 hours of test runs). Now a success removes it; a failure keeps it and names it."""
    import tempfile

    from packrat.errors import ProfileError
    from packrat.profile import ProfileSettings, run_profile

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    archive = make_tiny_archive(tmp_path / "tiny")
    settings = ProfileSettings(cores=1, max_batch=1, point_budget_s=0.3, corun=False)
    profile = run_profile(open_archive(archive), settings, progress=False)
    assert len(profile.points) == 1
    assert list(scratch.iterdir()) == []

    src = (archive / "packrat_handler.py").read_text()
    (archive / "packrat_handler.py").write_text(src.replace(
        "def load_task(model_dir, model_yaml_config):",
        "def load_task(model_dir, model_yaml_config):\n    raise ValueError('no weights here')"))
    with pytest.raises(ProfileError) as failed:
        run_profile(open_archive(archive), settings, progress=False)
    kept = list(scratch.iterdir())
    assert len(kept) == 1 and kept[0].name.startswith(f"packrat-profile-{os.getpid()}-")
    assert str(kept[0]) in str(failed.value)
    assert "no weights here" in kept[0].read_text()


def test_a_runner_killed_mid_profile_leaves_no_job_file(tmp_path):
    """The job file is read by its worker and removed by it at once: before, a runner killed
    -9 (no handler runs; tests end controllers that way) left /tmp/tmp*.json behind each time."""
    import signal

    archive = make_tiny_archive(tmp_path / "tiny")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    script = (
        "import sys\n"
        "from packrat.profile import ProfileSettings, open_archive, run_profile\n"
        "settings = ProfileSettings(cores=1, max_batch=1, point_budget_s=60, corun=False)\n"
        "run_profile(open_archive(sys.argv[1]), settings, progress=False,\n"
        "            on_event=lambda ev: print(ev['event'], flush=True))\n"
    )
    runner = subprocess.Popen([sys.executable, "-c", script, str(archive)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(scratch)}, start_new_session=True)
    try:
        for line in runner.stdout:  # "start": the worker has read its job and times its point
            if line.strip() == "start":
                break
        else:
            pytest.fail(f"the profile ended before its point started: rc {runner.wait()}")
        os.killpg(runner.pid, signal.SIGKILL)  # the runner, its fork server and the worker
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
        runner.wait()
    assert list(scratch.glob("*.json")) == [], sorted(p.name for p in scratch.iterdir())


@pytest.mark.parametrize(
    "args,message",
    [
        (["{missing}"], "no such file"),
        (["{empty}"], "not a Packrat archive"),
        (["{archive}", "--cores", "0"], "--cores"),
        (["{archive}", "--cores", "999"], "exceeds"),
        (["{archive}", "--max-batch", "0"], "--max-batch"),
        (["{archive}", "--budget", "-1"], "--budget"),
        (["{archive}", "--point-budget", "0"], "--point-budget"),
        (["{archive}", "--scope", "everything"], "--scope"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, message):
    archive = make_tiny_archive(tmp_path / "tiny")
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "archive": archive}
    res = packrat("profile", *[a.format(**paths) for a in args], "-o", str(tmp_path / "p.json"))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert not (tmp_path / "p.json").exists()


def test_worker_batches_put_the_planned_cap_first():
    from packrat.profile.runner import worker_batches

    batches = [4, 8, 1, 2]  # tune_batches(8, 2, 8): the caps B = 8 needs, then the rest
    assert worker_batches(batches, None, 2, 2) == batches
    assert worker_batches(batches, 8, 2, 2) == [8, 4, 1, 2]  # fat: B itself first
    assert worker_batches(batches, 8, 1, 2) == [4, 8, 1, 2]  # two 1-thread workers: B / 2
    assert worker_batches([1, 2], 8, 2, 2) == [1, 2]  # a cap not in the list adds nothing


@needs_two_cores
def test_a_tune_profile_times_fat_at_its_batch_first(tmp_path):
    """With plan_batch, each worker starts at the cap its widest plan needs: a budget that
    runs short then omits what the choice at B does not need (GPT-2 in a 40 s tune omitted
    fat at B = 8 before; docs/profiler.md)."""
    from packrat.profile import ProfileSettings, run_profile

    ref = open_archive(make_tiny_archive(tmp_path / "tiny"))
    starts: dict[int, list[int]] = {}

    def on_event(ev: dict) -> None:
        if ev.get("event") == "start":
            starts.setdefault(ev["threads"], []).append(ev["batch"])

    settings = ProfileSettings(cores=2, max_batch=4, point_budget_s=0.3, batches=(2, 4, 1),
                               plan_batch=4, corun=False)
    profile = run_profile(ref, settings, progress=False, on_event=on_event)
    assert starts == {1: [2, 4, 1], 2: [4, 2, 1]}
    assert {(p.threads, p.batch) for p in profile.points} == {(t, b) for t in (1, 2) for b in (1, 2, 4)}
