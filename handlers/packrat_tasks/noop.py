"""`noop`: no model; echoes the body. Measures TorchServe's own round trip."""

from __future__ import annotations

from typing import Any

from packrat_tasks.base import Batch, Task, request_value


class NoopTask(Task):
    name = "noop"

    def parse(self, request: dict) -> Any:
        value = request_value(request)
        return bytes(value) if isinstance(value, bytearray) else value

    def collate(self, batch: Batch) -> None:
        pass

    def forward(self, batch: Batch) -> Batch:
        return batch

    def respond(self, batch: Batch) -> list[Any]:
        return [batch.items[i] if batch.items[i] is not None else b"" for i in batch.valid]

    def sample_requests(self, n: int, sizes: dict[str, int] | None = None) -> list[dict]:
        return [{"body": b"ping"} for _ in range(n)]
