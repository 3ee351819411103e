"""A profiled and a served worker on the same slot run with identical thread settings.

The plan is only as true as the profile: if TorchServe's worker (the handler's
claim_and_pin) pinned differently from the profiler's worker, every predicted
latency would describe a process that never serves. Each side runs in a fresh
Python process, as it does for real, and prints packrat.slots.observed_settings().
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packrat.slots import parse_cpu_list

CORES = sorted(os.sched_getaffinity(0))
# Spelled out, not taken from packrat.slots: dropping one from the recipe must fail here.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")

# The profiler's worker, in run_job's order: pin and set the variables before
# anything imports torch or numpy, then size torch's pools.
PROFILED = """
import json, sys
from packrat.profile import worker
cores, threads = json.loads(sys.argv[1]), int(sys.argv[2])
worker.slots.pin_threads(cores, threads)
import torch
worker.slots.set_torch_threads(threads)
print(json.dumps(worker.slots.observed_settings()))
"""

# TorchServe's worker: torch is already imported (ts imports it) and other
# threads already run when the handler's initialize() calls claim_and_pin.
SERVED = """
import json, os, sys, threading
import torch
threading.Thread(target=threading.Event().wait, daemon=True).start()
from packrat import slots
cores, threads = json.loads(sys.argv[1]), int(sys.argv[2])
config = {"packrat": {"plan_id": "test-same-slot", "slots": [{"cores": cores, "threads": threads}]}}
claim = slots.claim_and_pin(config)
assert claim is not None and claim.cores == tuple(cores) and claim.threads == threads
status = slots.read_worker_status(os.getpid())
report = slots.observed_settings()
assert {k: status[k] for k in report} == report, (status, report)
print(json.dumps(report))
"""


def _slots_to_test() -> list[tuple[list[int], int]]:
    cases = [(CORES[:1], 1)]
    if len(CORES) >= 2:
        cases.append((CORES[:2], 2))
    return cases


def test_profiled_and_served_worker_report_identical_thread_settings(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}  # nothing inherited
    procs = {}
    for i, (cores, threads) in enumerate(_slots_to_test()):
        for side, code in (("profiled", PROFILED), ("served", SERVED)):
            side_env = dict(env, PACKRAT_SLOT_DIR=str(tmp_path / f"slots-{i}"))
            procs[(i, side)] = subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(cores), str(threads)],
                env=side_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
    reports = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{key}: {err}"
        reports[key] = json.loads(out.strip().splitlines()[-1])

    for i, (cores, threads) in enumerate(_slots_to_test()):
        profiled, served = reports[(i, "profiled")], reports[(i, "served")]
        assert profiled == served
        # ... and both are the slot: every thread on its cores, its pool sizes.
        assert set(parse_cpu_list(profiled["cpus_allowed_list"])) == set(cores)
        assert [set(parse_cpu_list(c)) for c in profiled["thread_cpu_lists"]] == [set(cores)]
        assert profiled["torch_threads"] == threads and profiled["interop_threads"] == 1
        assert profiled["thread_env"] == {var: str(threads) for var in THREAD_VARS}


NICE_PROBE = """
import json, os, sys, threading
from packrat.slots import lowered_priority

def nices():
    return sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})

started = threading.Event()
stop = threading.Event()
with lowered_priority(int(sys.argv[1])) as low:
    threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True).start()  # a pool born inside
    started.wait()
    inside = nices()
after = nices()
stop.set()
print(json.dumps({"active": low.active, "inside": inside, "after": after}))
"""


def _nice_probe(extra: int, prefix: list[str] | None = None) -> dict:
    out = subprocess.run([*(prefix or []), sys.executable, "-c", NICE_PROBE, str(extra)],
                         capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def test_a_loading_worker_yields_priority_and_every_thread_gets_it_back() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = _nice_probe(5)
    if not seen["active"]:
        pytest.skip("this process may not lower its nice value again (no CAP_SYS_NICE, RLIMIT_NICE 0)")
    assert seen["inside"] == [min(19, base + 5)]  # both threads, the one started inside too
    assert seen["after"] == [base]
    assert _nice_probe(0) == {"active": False, "inside": [base], "after": [base]}


def test_without_the_right_to_lower_it_again_the_priority_is_left_alone() -> None:
    # A worker that could raise its nice value but not lower it would serve deprioritised.
    if os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists():
        pytest.skip("needs root and setpriv to drop CAP_SYS_NICE")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    drop = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"]
    assert _nice_probe(5, drop) == {"active": False, "inside": [base], "after": [base]}
