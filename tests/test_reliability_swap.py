"""No accepted request is dropped when a swap retires a version whose worker holds a batch.

TorchServe 0.12's frontend hands a batch to a worker's Python process over a
socket. A Python worker that has not read it yet (starved of CPU on a busy
machine; here: stopped with SIGSTOP) holds jobs that are in neither the
version's `pendingRequests` nor the batch counters packrat.slots keeps. The
old drain therefore found the version idle and unregistered it; the worker's
shutdown put the jobs back into the queue of a version that no longer
existed: never answered. Now the drain also reads the bytes waiting unread in
each worker's socket (sock_diag, like `ss -x`), and retirement scales the
still-registered version to 0 workers and confirms its queue is empty before
it unregisters, serving whatever came back.

The model sleeps a table latency per batch and claims its slot like Packrat's
handler (tests/data/observe/sleepmodel). No timing threshold decides a pass:
the stopped worker holds its batch for as long as the test wants.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

from packrat import slots
from packrat.apply import versions
from packrat.apply.swap import Swapper, pending_requests
from packrat.types import Instance, Plan
from reliability_support import copy_sleep_model, holding_unread, wait_for
from serving_support import start_server, stop_in_background, usable_cores

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]

MODEL = "held"
# The stopped worker is resumed this long after the drain began (see the test).
RESUME_AFTER_S = 4.0
NEW = Plan(cores=2, batch=1, instances=(Instance(1, 1, 0.0), Instance(1, 1, 0.0)), predicted_latency_ms=0.0)


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # already shut down by TorchServe


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("held-store")
    copy_sleep_model(store, MODEL)
    server = start_server(store, tmp_path_factory.mktemp("held-ts"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            # The Swapper in this process reads the workers' status files.
            mp.setenv("PACKRAT_SLOT_DIR", str(server.slot_dir))
            server.register(MODEL)  # 1 worker, batch cap 1
            yield server, store
    finally:
        stop_in_background(server)


def test_batch_held_by_a_stopped_worker_is_answered_across_a_swap(served) -> None:
    server, store = served
    client = server.management_client()
    swapper = Swapper(client, store, cores=list(usable_cores(2)))
    old = client.describe(MODEL)
    (pid,) = [w["pid"] for w in old["workers"]]
    url = f"{server.inference_url}/predictions/{MODEL}"
    answers: dict[str, tuple[int, str]] = {}

    def send(key: str) -> None:
        try:
            r = requests.post(url, data=key.encode(), headers=server.inference_headers(), timeout=90)
            answers[key] = (r.status_code, r.text[:200])
        except requests.RequestException as exc:
            answers[key] = (0, repr(exc))

    os.kill(pid, signal.SIGSTOP)
    try:
        held = threading.Thread(target=send, args=("held",))
        held.start()
        # The frontend takes the job from the queue at once and writes it to the stopped
        # worker: the queue is empty and the worker's counters say idle.
        wait_for(lambda: pending_requests(client.describe(MODEL)) == 0 and holding_unread([pid]), 30,
                 "the job to leave the queue for the worker's socket")
        time.sleep(0.5)
        status = slots.read_worker_status(pid)
        assert status is not None and status["started"] == status["done"] and not status["busy"]

        phases: list[str] = []
        after: list[threading.Thread] = []

        def on_phase(rec) -> None:
            phases.append(rec.phase)
            if rec.phase == "drain":  # the new version is the default: it must serve meanwhile
                for k in range(4):
                    t = threading.Thread(target=send, args=(f"new-{k}",))
                    t.start()
                    after.append(t)
                # Retirement of the old version began: let its worker go on, later than
                # the old drain's 2 s minimum (it unregistered then, and lost the batch).
                threading.Timer(RESUME_AFTER_S, resume, (pid,)).start()

        record = swapper.apply(MODEL, NEW, on_phase=on_phase)
    finally:
        resume(pid)  # whatever happened above, never leave a stopped process behind
    held.join(timeout=120)
    for t in after:
        t.join(timeout=120)
    print(f"swap {record.phases_s} warnings {record.warnings}; answers {answers}")
    assert phases == ["create", "register", "ready", "set_default", "drain", "retire"]
    assert record.outcome == "applied", record
    assert answers["held"][0] == 200, answers["held"]
    assert json.loads(answers["held"][1])["batch"] == 1
    assert [answers[f"new-{k}"][0] for k in range(4)] == [200] * 4, answers
    # The drain waited for the batch the stopped worker had not read (it cannot finish earlier).
    assert dict(record.phases_s)["drain"] >= RESUME_AFTER_S
    assert [d["modelVersion"] for d in client.describe_all(MODEL)] == [record.to_version]


def test_retire_serves_jobs_left_in_the_queue_of_a_version_scaled_to_zero(served) -> None:
    """The state a controller killed between "scale to 0" and "unregister" leaves: a
    non-default version without workers and with jobs in its queue. retire() (what
    the restarted controller's attach runs) scales it up, serves them, then unregisters."""
    server, store = served
    client = server.management_client()
    swapper = Swapper(client, store, cores=list(usable_cores(2)))
    live = client.describe(MODEL)["modelVersion"]
    one = Plan(cores=2, batch=1, instances=(Instance(2, 1, 0.0),), predicted_latency_ms=0.0)
    extra = versions.create_version(store, MODEL, MODEL, one, list(usable_cores(2)))
    client.register(extra.url, MODEL, 1)
    wait_for(lambda: [w["status"] for w in client.describe(MODEL, extra.version)["workers"]] == ["READY"],
             120, "the extra version's worker")
    (pid,) = [w["pid"] for w in client.describe(MODEL, extra.version)["workers"]]
    url = f"{server.inference_url}/predictions/{MODEL}/{extra.version}"
    answers: dict[str, int] = {}

    def send(key: str) -> None:
        r = requests.post(url, data=key.encode(), headers=server.inference_headers(), timeout=120)
        answers[key] = r.status_code

    os.kill(pid, signal.SIGSTOP)
    threads = [threading.Thread(target=send, args=("a",))]
    threads[0].start()
    # pendingRequests is 0 before a reaches the queue too: wait until it sits unread in the
    # worker's socket, else b may be the one taken and a, still on its way, queue after it.
    wait_for(lambda: pending_requests(client.describe(MODEL, extra.version)) == 0 and holding_unread([pid]),
             30, "a taken by the worker")
    threads.append(threading.Thread(target=send, args=("b",)))
    threads[1].start()  # the only worker is busy with a: b waits in the queue
    wait_for(lambda: pending_requests(client.describe(MODEL, extra.version)) == 1, 30, "b queued")
    client.scale(MODEL, extra.version, 0)  # what the killed controller had done
    resume(pid)  # a no-op: the scale-down killed it
    assert pending_requests(client.describe(MODEL, extra.version)) >= 1
    returned = swapper.retire(MODEL, extra.version)
    for t in threads:
        t.join(timeout=120)
    assert returned >= 1
    assert answers["b"] == 200  # it was in the queue: unregistering first would have lost it
    # a was in flight on the worker the simulated scale-down killed: TorchServe puts it back
    # into the queue (then it is served) or answers 500 "Worker died." (a race in its
    # WorkerThread.shutdown); either way it is answered.
    assert answers["a"] in (200, 500)
    assert [d["modelVersion"] for d in client.describe_all(MODEL)] == [live]
