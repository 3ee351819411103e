"""What every task shares: request parsing, per-item errors, the batch pipeline.

A batch flows as

    requests --preprocess--> Batch --forward--> Batch (with outputs) --postprocess--> responses

`Batch` keeps the position of every request: the ones that failed to parse
carry a RequestError and skip the model; the others are stacked into tensors.
postprocess() returns one response per request, in order; a failed one is an
ErrorResponse (a dict, so TorchServe serialises it as JSON) whose status
handle() reports through context.set_response_status(code, phrase, idx) — the
per-item status TorchServe 0.12 sends as that request's HTTP status.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# HTTP reason phrases for the statuses we use.
PHRASES = {400: "Bad Request", 413: "Payload Too Large", 415: "Unsupported Media Type"}


class RequestError(Exception):
    """One request is unusable; only that request fails."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ErrorResponse(dict):
    """The JSON error body of one failed request; `.status` is its HTTP status."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(code=error.status, type="BadInput", message=error.message)
        self.status = error.status


@dataclass
class Batch:
    """A batch in flight: parsed items, model inputs, model outputs, per-item errors."""

    size: int
    errors: dict[int, RequestError] = field(default_factory=dict)
    items: dict[int, Any] = field(default_factory=dict)  # index -> parsed request
    valid: list[int] = field(default_factory=list)  # indices that go through the model
    inputs: dict[str, Any] = field(default_factory=dict)  # tensors for the valid rows
    outputs: Any = None


def request_value(request: dict) -> Any:
    """The payload of one TorchServe request item: raw body or decoded JSON."""
    for key in ("body", "data"):
        if request.get(key) is not None:
            return request[key]
    # multipart/form-data: the first field
    for key, value in request.items():
        if key != "content_type" and value is not None:
            return value
    return None


def reject_form(request: dict) -> None:
    """curl -d sends application/x-www-form-urlencoded; TorchServe then splits the
    body into form fields and the text is lost, so say how to send it instead."""
    if "x-www-form-urlencoded" in str(request.get("content_type", "")).lower():
        raise RequestError(
            415, "form-encoded body (curl -d); send the raw body with --data-binary and "
            "Content-Type: text/plain, application/json or application/octet-stream",
        )


def parse_json_or_text(request: dict) -> Any:
    """Decode a text-ish payload to a dict (JSON object) or a str.

    TorchServe already decodes bodies sent as application/json (dict/list/...)
    and text/* (str); when its decoding failed it passes the raw bytes. Raw
    bytes that start with "{" are parsed as JSON here, so a client that forgets
    the content type still gets JSON semantics.
    """
    reject_form(request)
    value = request_value(request)
    if value is None:
        raise RequestError(400, "empty request: no body")
    if isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
        if not raw.strip():
            raise RequestError(400, "empty request body")
        declared_json = "json" in str(request.get("content_type", "")).lower()
        if declared_json or raw.lstrip().startswith(b"{"):
            try:
                value = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise RequestError(400, f"malformed JSON body: {exc}") from None
        else:
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RequestError(400, f"body is not valid UTF-8 text: {exc}") from None
    if isinstance(value, str):
        if not value.strip():
            raise RequestError(400, "empty text")
        return value
    if isinstance(value, dict):
        return value
    raise RequestError(
        400, f"expected raw text or a JSON object, got a JSON {type(value).__name__}"
    )


def get_field(obj: dict, name: str, kind: type, default: Any = None, required: bool = False) -> Any:
    """A typed field of a JSON object; bool is not accepted where int is asked."""
    if name not in obj or obj[name] is None:
        if required:
            raise RequestError(400, f"missing field {name!r}")
        return default
    value = obj[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(
            400, f"field {name!r} must be {kind.__name__}, got {type(value).__name__}"
        )
    return value


class Task:
    """Base class: subclasses implement parse(), collate(), forward() and respond()."""

    name = "base"

    def __init__(self, model_dir: str, config: dict[str, Any]) -> None:
        self.model_dir = model_dir
        self.config = config  # the archive's model_config.yaml, whole

    # -- hooks for subclasses ------------------------------------------------
    def parse(self, request: dict) -> Any:
        """One request -> parsed item; raise RequestError for bad input."""
        raise NotImplementedError

    def collate(self, batch: Batch) -> None:
        """Fill batch.inputs from batch.items[i] for i in batch.valid."""
        raise NotImplementedError

    def forward(self, batch: Batch) -> Batch:
        """Model only. Sets batch.outputs."""
        raise NotImplementedError

    def respond(self, batch: Batch) -> list[Any]:
        """One response per valid row, in batch.valid order."""
        raise NotImplementedError

    def sample_requests(self, n: int) -> list[dict]:
        """n realistic TorchServe-style request items, e.g. [{"body": b"..."}]."""
        raise NotImplementedError

    # -- the pipeline (the same for every task) ------------------------------
    def preprocess(self, requests: list[dict]) -> Batch:
        batch = Batch(size=len(requests))
        for i, request in enumerate(requests):
            try:
                batch.items[i] = self.parse(request)
                batch.valid.append(i)
            except RequestError as exc:
                batch.errors[i] = exc
        if batch.valid:
            self.collate(batch)
        return batch

    def postprocess(self, batch: Batch) -> list[Any]:
        good = iter(self.respond(batch) if batch.valid else [])
        return [
            ErrorResponse(batch.errors[i]) if i in batch.errors else next(good)
            for i in range(batch.size)
        ]

    def run(self, requests: list[dict]) -> list[Any]:
        batch = self.preprocess(requests)
        if batch.valid:
            batch = self.forward(batch)
        return self.postprocess(batch)

    def handle(self, data: list[dict], context: Any) -> list[Any]:
        requests = [_with_content_type(r, context, i) for i, r in enumerate(data)]
        responses = self.run(requests)
        for i, response in enumerate(responses):
            # Lets clients (and tests) see how TorchServe batched their request.
            context.set_response_header(i, "x-packrat-batch-size", str(len(requests)))
            if isinstance(response, ErrorResponse):
                context.set_response_status(
                    response.status, PHRASES.get(response.status, "Bad Request"), i
                )
        return responses


def _with_content_type(request: dict, context: Any, idx: int) -> dict:
    """Copy the request's Content-Type into the item (TorchServe keeps it in headers)."""
    try:
        headers = context.get_all_request_header(idx) or {}
    except (AttributeError, IndexError, TypeError):
        return request
    ctype = next((v for k, v in headers.items() if k.lower() == "content-type"), None)
    if ctype and "content_type" not in request:
        request = dict(request)
        request["content_type"] = ctype
    return request
