"""The efficiency benchmark's lean peer (issue 35 item 1): the archive's own Task served by
LitServe, as a lean user would write it. Runs in its own process group:

    python -m packrat.bench.peer_server JOB.json

(packrat.bench.peer writes the job and starts it). One LitServe inference worker per plan
worker, each pinned the served worker's way (packrat.slots, before torch is imported)
to its core block and thread count, then loading the archive's Task through the
archive's own `packrat_handler.load_task` with the benchmark's config (the mode in it),
so the same build-cache artefact runs as in the raw, handler and served levels.

The body: LitServe 0.2.19 parses a request on its HTTP side (`await request.json()`, or a
form) before it crosses to the worker process, so decode_request never sees raw bytes;
the client therefore sends the served level's body base64-encoded in JSON
({"body_b64", "content_type"}), and decode_request turns it back into the item
TorchServe would hand the handler ({"body": bytes, "content_type"}).

Each worker and each HTTP server process notes its pid in the job's notes directory,
so the benchmark can name every process whose CPU it reads.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import litserve as ls
from fastapi.responses import JSONResponse

from packrat import slots  # imports no numeric library: safe before pinning

# LitServe listens on 0.0.0.0 by default; the benchmark's client is on loopback, so only there.
HOST = "127.0.0.1"


def note(notes_dir: str, role: str, **fields: Any) -> None:
    """<notes_dir>/<role>-<pid>.json: this process is one of the peer's `role` processes."""
    path = Path(notes_dir) / f"{role}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "role": role, **fields}))
    tmp.replace(path)  # whole or absent: the parent polls these files


class TaskAPI(ls.LitAPI):
    """The archive's Task behind LitServe: items in, the Task's answers out."""

    def __init__(self, job: dict[str, Any]) -> None:
        # LitServe has one batch cap for all its workers: a mixed plan's largest.
        cap = max(cap for _, cap in job["shape"])
        super().__init__(max_batch_size=cap, batch_timeout=float(job["batch_timeout_s"]))
        self.job = job
        self.task: Any = None

    def setup(self, device: str) -> None:
        # LitServe sets LITSERVE_WORKER_ID before setup(): it picks this worker's block.
        k = int(os.environ["LITSERVE_WORKER_ID"])
        threads, cores = int(self.job["shape"][k][0]), list(self.job["blocks"][k])
        slots.pin_process(cores, threads)  # affinity and pool sizes before the model loads
        sys.path.insert(0, self.job["archive_dir"])
        import packrat_handler  # the archive's own handler module

        self.task = packrat_handler.load_task(self.job["archive_dir"], self.job["config"])
        note(self.job["notes_dir"], "worker", worker=k, threads=threads, cores=cores,
             observed=slots.observed_settings())

    # `request` stays unannotated: LitServe makes decode_request's annotation the endpoint's
    # parameter type, and only none (a starlette Request) gets the JSON body parsed into a dict.
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        return {"body": base64.b64decode(request["body_b64"]), "content_type": request["content_type"]}

    def predict(self, x: Any) -> Any:
        # max_batch_size 1 runs LitServe's unbatched loop: one item in, one answer out.
        if self.max_batch_size == 1:
            return self.task.run([x])[0]
        return self.task.run(x)

    def encode_response(self, output: Any) -> Any:
        status = getattr(output, "status", None)  # the Task's ErrorResponse: its JSON with its status
        return JSONResponse(dict(output), status_code=status) if status else output


class NotedServer(ls.LitServer):
    """LitServer whose HTTP server processes note their pids when they start."""

    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        note(self.lit_api.job["notes_dir"], "http")
        async with super().lifespan(app):
            yield


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m packrat.bench.peer_server JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[1]).read_text())
    server = NotedServer(TaskAPI(job), accelerator="cpu", workers_per_device=len(job["shape"]),
                         timeout=float(job["timeout_s"]))
    server.run(host=HOST, port=int(job["port"]), log_level="warning", generate_client_file=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
