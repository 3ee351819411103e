"""TorchServe 0.12 sends each batch to its worker from CompletableFuture.runAsync on the
JVM's common pool. Where that pool's parallelism is below 2 (the default on a 2-core
machine) the JDK starts a new thread per batch instead; config.properties' vmargs raises
it. Checked on the running frontend: after a few batches, the batches were sent from the
pool's threads (/proc's thread names), so no thread was started for each."""

from __future__ import annotations

from pathlib import Path

import requests

from packrat.bench.proc_cpu import comm, group_members
from packrat.server import DEFAULT_CONFIG, read_properties
from serving_support import ensure_registered

PARALLELISM = "-Djava.util.concurrent.ForkJoinPool.common.parallelism="


def _thread_names(pid: int) -> list[str]:
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            continue  # the thread ended meanwhile
    return names


def test_the_shipped_config_turns_the_common_pool_on() -> None:
    vmargs = read_properties(DEFAULT_CONFIG).get("vmargs", "")
    values = [int(a.split("=", 1)[1]) for a in vmargs.split() if a.startswith(PARALLELISM)]
    assert values and values[0] >= 2, f"config.properties vmargs: {vmargs!r}"


def test_batches_are_sent_from_the_common_pool(torchserve) -> None:
    ensure_registered(torchserve, "noop")
    url = f"{torchserve.inference_url}/predictions/noop"
    headers = torchserve.inference_headers()
    for i in range(10):
        r = requests.post(url, data=f"pool {i}".encode(), headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    jvms = [pid for pid in group_members(torchserve.pid) if comm(pid) == "java"]
    assert len(jvms) == 1, f"TorchServe's process group: {group_members(torchserve.pid)}"
    # Linux keeps 15 characters of a thread's name: "ForkJoinPool.commonPool-worker-1"
    # reads "ForkJoinPool.co". Idle pool threads live 60 s, so they are still there.
    names = _thread_names(jvms[0])
    assert any(n.startswith("ForkJoinPool.co") for n in names), (
        f"no common-pool thread in the frontend after 10 batches: the JDK started a thread "
        f"per batch (threads now: {sorted(set(names))})")
