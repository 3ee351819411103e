"""What every task shares: request parsing, per-item errors, the batch pipeline.

A batch flows as

    requests --preprocess--> Batch --forward--> Batch (with outputs) --postprocess--> responses

`Batch` keeps the position of every request: the ones that failed to parse
carry a RequestError and skip the model; the others are stacked into tensors.
postprocess() returns one response per request, in order; a failed one is an
ErrorResponse (a dict, JSON like the others) whose status handle() reports
through context.set_response_status(code, phrase, idx) — the per-item status
TorchServe 0.12 sends as that request's HTTP status.

handle() hands TorchServe each JSON response already encoded (encode_json), with
content type application/json: TorchServe 0.12 encodes any other object with
json.dumps(indent=2), which runs the pure-Python encoder. For MiniLM's 384-float
embeddings that took 11 % of a served worker's time on the Zen 3 EPYC, and json's C
encoder still 8 % (py-spy, docs/benchmarks/code-ab-json-encode-minilm8.md); orjson
writes the same values (each float's shortest round-trip digits) 10x faster (119 us a
batch of 4 against 1245, docs/benchmarks/code-ab-orjson-minilm8.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from packrat.slots import record_sizes

try:
    import orjson
except ImportError:  # a pinned dependency (pyproject.toml); without it json's C encoder serves
    orjson = None

# HTTP reason phrases for the statuses we use.
PHRASES = {400: "Bad Request", 413: "Payload Too Large", 415: "Unsupported Media Type"}

# Input limits shared by the tasks (docs/handler.md). Each is a default that an
# archive overrides under model_config.yaml's `packrat:` section.
MAX_BODY_BYTES = 1 << 20  # packrat.max_body_bytes: a request body, before it is decoded
MAX_JSON_DEPTH = 32  # packrat.max_json_depth: our JSON inputs are flat objects (depth 1)
# packrat.max_text_chars defaults to this many characters per token of max_length,
# checked before tokenising. English runs at ~4-5 characters a token; the slack
# covers whitespace and long words, which WordPiece turns into one [UNK] token
# (so no character count is an exact bound on tokens).
TEXT_CHARS_PER_TOKEN = 32

# JSON string literals, an unterminated one included (it runs to the end): possessive,
# so the scan is linear and cannot backtrack on hostile input.
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


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


def check_body_size(raw: bytes, max_bytes: int) -> None:
    if len(raw) > max_bytes:
        raise RequestError(413, f"body is {len(raw)} bytes; the limit is {max_bytes}")


def declares_json(request: dict) -> bool:
    return "json" in str(request.get("content_type", "")).lower()


def json_depth(raw: bytes) -> int:
    """Deepest bracket nesting of a JSON text, strings skipped; linear, no recursion."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def decoded_depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether an already decoded JSON value nests deeper than max_depth (iterative)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > max_depth:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def load_json(raw: bytes, max_depth: int) -> Any:
    """Parse a JSON body whose size was checked, refusing deep nesting before parsing.

    json.loads recurses once per level and raises RecursionError near Python's
    limit (1000), which used to fail the whole batch with 503; numbers of more
    than 4300 digits raise a plain ValueError (int conversion limit).
    """
    depth = json_depth(raw)
    if depth > max_depth:
        raise RequestError(400, f"JSON nesting depth {depth} exceeds the limit of {max_depth}")
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise RequestError(400, f"malformed JSON body: {exc}") from None


def check_text(text: str, max_chars: int) -> str:
    """Bound a text by characters before it is tokenised, and refuse what cannot be UTF-8."""
    if not text.strip():
        raise RequestError(400, "empty text")
    if len(text) > max_chars:
        raise RequestError(413, f"text is {len(text)} characters long; the limit is {max_chars}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON "\ud800" escape; the tokenizer raises TypeError
        raise RequestError(400, "text contains an unpaired UTF-16 surrogate (invalid \\u escape)") from None
    return text


def parse_json_or_text(request: dict, max_bytes: int = MAX_BODY_BYTES,
                       max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode a text-ish payload to a dict (JSON object) or a str.

    Packrat's workers receive every body as raw bytes (packrat_handler turns
    TorchServe's own decoding off), so size and nesting are checked here before
    anything is decoded. Raw bytes that start with "{" are parsed as JSON, so a
    client that forgets the content type still gets JSON semantics. A str or
    dict (a worker where TorchServe did decode) is accepted too.
    """
    reject_form(request)
    value = request_value(request)
    if value is None:
        raise RequestError(400, "empty request: no body")
    if isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
        check_body_size(raw, max_bytes)
        if not raw.strip():
            raise RequestError(400, "empty request body")
        if declares_json(request) or raw.lstrip().startswith(b"{"):
            value = load_json(raw, max_depth)
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
        if decoded_depth_exceeds(value, max_depth):
            raise RequestError(400, f"JSON nesting depth exceeds the limit of {max_depth}")
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


def model_labels(model_path: str) -> dict[int, str]:
    """id2label of the model directory's config.json, read as JSON: a worker that serves
    from the build cache alone then never imports transformers (~0.5 s of CPU per worker
    start on the 2-core EPYC). A config without id2label gets transformers'
    default, LABEL_0 .. LABEL_{num_labels - 1} with 2 labels unless num_labels says
    otherwise (tests/test_worker_imports.py compares with AutoConfig)."""
    import os

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        import transformers

        return dict(transformers.AutoConfig.from_pretrained(model_path).id2label)
    labels = config.get("id2label")
    if isinstance(labels, dict) and labels:
        return {int(k): str(v) for k, v in labels.items()}
    return {i: f"LABEL_{i}" for i in range(int(config.get("num_labels", 2)))}


class Task:
    """Base class: subclasses implement parse(), collate(), forward() and respond()."""

    name = "base"

    def __init__(self, model_dir: str, config: dict[str, Any]) -> None:
        self.model_dir = model_dir
        self.config = config  # the archive's model_config.yaml, whole
        section = config.get("packrat") or {}
        self.max_body_bytes = int(section.get("max_body_bytes", MAX_BODY_BYTES))
        self.max_json_depth = int(section.get("max_json_depth", MAX_JSON_DEPTH))

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

    def sample_requests(self, n: int, sizes: dict[str, int] | None = None) -> list[dict]:
        """n realistic TorchServe-style request items, e.g. [{"body": b"..."}].

        `sizes`: the size to make them, per kind (served_sizes' kinds: a representative
        size of the traffic, e.g. from the workers' histograms); a kind the task does not
        serve is ignored, and without one the task makes its own sample size."""
        raise NotImplementedError

    def served_sizes(self, batch: Batch, responses: list[Any]) -> dict[str, list[int]]:
        """The size of each request this batch served, per kind of size
        (packrat.worker_counters.SIZE_KINDS: "tokens", "pixels", "generated"): the
        worker counts them in its size histogram, which the controller reads for the
        shape of the traffic. Runs once per served batch: keep it a list comprehension."""
        return {}

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

    def serve(self, requests: list[dict]) -> tuple[Batch, list[Any]]:
        batch = self.preprocess(requests)
        if batch.valid:
            batch = self.forward(batch)
        return batch, self.postprocess(batch)

    def run(self, requests: list[dict]) -> list[Any]:
        return self.serve(requests)[1]

    def handle(self, data: list[dict], context: Any) -> list[Any]:
        requests = [_with_content_type(r, context, i) for i, r in enumerate(data)]
        batch, responses = self.serve(requests)
        if batch.valid:  # only what TorchServe hands over is traffic (not the profiler's or guard's runs)
            record_sizes(self.served_sizes(batch, responses))
        out: list[Any] = []
        for i, response in enumerate(responses):
            # Lets clients (and tests) see how TorchServe batched their request.
            context.set_response_header(i, "x-packrat-batch-size", str(len(requests)))
            if isinstance(response, ErrorResponse):
                context.set_response_status(
                    response.status, PHRASES.get(response.status, "Bad Request"), i
                )
            encoded = encode_json(response)
            if encoded is not response:
                context.set_response_content_type(i, JSON_CONTENT_TYPE)
            out.append(encoded)
        return out


JSON_CONTENT_TYPE = "application/json"


def encode_json(response: Any) -> Any:
    """A JSON response as compact UTF-8 bytes (orjson; json's C encoder for what orjson
    refuses, e.g. non-str keys or integers past 64 bits); bytes and str as they are (the task
    chose their form), and an object neither can encode also as it is (TorchServe then
    answers that request 503, as it did before). NaN and infinities come out as null
    (orjson), not as the bare NaN json writes, which is not JSON."""
    if isinstance(response, (bytes, bytearray, str)):
        return response
    if orjson is not None:
        try:
            return orjson.dumps(response)
        except TypeError:  # orjson.JSONEncodeError
            pass
    try:
        return json.dumps(response, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError):
        return response


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
