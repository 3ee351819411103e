"""Fuzzed requests for every task: hypothesis strategies shared by
tests/test_fuzz_inputs.py (a few hundred, in CI) and scripts/fuzz_inputs.py
(the long campaign). Needs hypothesis (the test extra).

Each strategy draws a `Fuzz`: an input class (`kind`, the row of
docs/reliability.md it counts towards), a body and a Content-Type. Bodies stay
below TorchServe's own 6.5 MB request limit, except the size probes, which sit
just around a given limit; real images are kept small enough (`max_pixels`)
that even uncompressed BMP in base64 stays under it; images claiming huge
sizes are crafted headers, never allocated here. The campaign adds images at
and past the shipped default limits (large_images(): up to 8000x8000 of cheap
content, bodies padded to TorchServe's request limit and to 10 MiB).
"""

from __future__ import annotations

import base64
import functools
import io
import json
import struct
import zlib

from hypothesis import strategies as st
from PIL import Image

# What a fuzzed request may be answered: success or a refusal documented in
# docs/handler.md. Anything else (5xx above all) is a failure.
DOCUMENTED = frozenset({200, 400, 413, 415})

TASKS = ("noop", "text-classification", "feature-extraction", "text-generation", "image-classification")


class Fuzz:
    """One fuzzed request: its input class, body and Content-Type (None: no header)."""

    __slots__ = ("kind", "body", "content_type")

    def __init__(self, kind: str, body: bytes, content_type: str | None = None) -> None:
        self.kind, self.body, self.content_type = kind, body, content_type

    def kwargs(self) -> dict:
        """Keyword arguments for tests/serving_support.predict."""
        return {"body": self.body, "headers": {"Content-Type": self.content_type} if self.content_type else {}}

    def __repr__(self) -> str:  # hypothesis prints failing examples: keep them short
        return f"Fuzz({self.kind!r}, {len(self.body)} bytes {self.body[:120]!r}..., {self.content_type!r})"

    def _repr_pretty_(self, p, cycle) -> None:  # hypothesis' printer
        p.text(repr(self))


# Not application/x-www-form-urlencoded, nor multipart/form-data without a
# boundary (which TorchServe decodes the same way): TorchServe's frontend parses
# such a body itself and answers a malformed %-escape or an empty field name
# (also one of only whitespace) with 500 before any worker sees it
# (FORM_TYPES; docs/reliability.md). form_bodies() sends well-formed ones.
CONTENT_TYPES = st.sampled_from([
    None, "application/json", "application/json; charset=utf-8", "text/plain",
    "text/plain; charset=utf-8", "application/octet-stream", "image/png", "image/jpeg",
])
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
JSON_TYPES = st.sampled_from([None, "application/json", "application/json; charset=utf-8", "text/plain"])

# -- text and JSON ----------------------------------------------------------------
# Text with lone surrogates too: JSON can carry them as "\ud800" escapes.
TEXTS = st.one_of(
    st.text(max_size=200),
    st.text(st.sampled_from(["\ud800", "\udfff", "a", " ", "\u00e9", "\U0001f600", "\x00"]), max_size=30),
    st.integers(0, 5000).map(lambda n: "word " * n),  # around the token and character limits
    st.integers(0, 5000).map(lambda n: "a" * n),  # one long word: one [UNK] token however long
)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
JSON_VALUES = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                      max_size=4),
                           max_leaves=16)


def _dump(value: object, ensure_ascii: bool) -> bytes:
    # surrogatepass: a lone surrogate becomes bytes that are not UTF-8 (the
    # ensure_ascii=False path), or a "\ud800" escape (ensure_ascii=True).
    return json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


@st.composite
def json_bodies(draw, fields: dict[str, st.SearchStrategy]) -> Fuzz:
    """A JSON object with the task's fields (each present or not) holding any JSON value."""
    optional = {name: st.one_of(strategy, JSON_VALUES) for name, strategy in fields.items()}
    obj = draw(st.fixed_dictionaries({}, optional=optional))
    obj.update(draw(st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=2)))
    return Fuzz("json-fields", _dump(obj, draw(st.booleans())), draw(JSON_TYPES))


@st.composite
def any_json(draw) -> Fuzz:
    return Fuzz("json-any", _dump(draw(JSON_VALUES), draw(st.booleans())), draw(JSON_TYPES))


@st.composite
def nested_json(draw) -> Fuzz:
    """Deep nesting, up to past Python's recursion limit (the 503 of issue 14)."""
    depth = draw(st.one_of(st.integers(0, 64), st.integers(0, 120_000)))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    inner = opener * depth + b"1" + closer * depth
    if draw(st.booleans()):
        inner = b'{"text": "hi", "image": "", "x": ' + inner + b"}"
    if draw(st.booleans()):  # cut: malformed as well as deep
        inner = inner[: draw(st.integers(0, len(inner)))]
    return Fuzz("json-deep", inner, draw(JSON_TYPES))


@st.composite
def huge_numbers(draw) -> Fuzz:
    digits = draw(st.integers(1, 6000))  # Python refuses int literals above 4300 digits (ValueError)
    return Fuzz("json-number", b'{"text": "hi", "top_k": ' + b"9" * digits + b"}", draw(JSON_TYPES))


@st.composite
def raw_bytes(draw) -> Fuzz:
    return Fuzz("bytes", draw(st.binary(max_size=4096)), draw(CONTENT_TYPES))


@st.composite
def raw_text(draw) -> Fuzz:
    return Fuzz("text", draw(TEXTS).encode("utf-8", "surrogatepass"), draw(CONTENT_TYPES))


@st.composite
def form_bodies(draw) -> Fuzz:
    """curl -d: a well-formed form-encoded body (refused with 415 by the model tasks)."""
    from urllib.parse import urlencode

    # Names without whitespace or control characters: the frontend trims names
    # and answers an empty one with 500 (FORM_TYPES above).
    names = st.text(st.characters(categories=("L", "N", "P", "S")), min_size=1, max_size=8)
    fields = draw(st.dictionaries(names, st.text(max_size=40), max_size=3))
    return Fuzz("form", urlencode(fields).encode("utf-8", "surrogatepass"), "application/x-www-form-urlencoded")


@st.composite
def big_bodies(draw, around: int) -> Fuzz:
    """A body just under or over a size limit (the handler's body limit, in bytes)."""
    size = draw(st.integers(max(0, around - 64), around + 64))
    fill = draw(st.sampled_from([b"a", b" ", b"{", b"\xff"]))
    return Fuzz("size", fill * size, draw(CONTENT_TYPES))


# -- images -----------------------------------------------------------------------
IMAGE_FORMATS = ["JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP", "PPM"]
MODES = ["RGB", "L", "RGBA", "P", "1", "LA", "I;16", "CMYK", "I", "F"]


def encode_image(w: int, h: int, mode: str, fmt: str, noise: bool, seed: int) -> bytes:
    """A real w x h image in `mode`, saved as `fmt` (converted to RGB when the format refuses the mode)."""
    import numpy as np

    if noise:
        rng = np.random.default_rng(seed)
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    else:
        img = Image.new("RGB", (w, h), (seed % 256, 40, 200))
    try:
        img = img.convert(mode)
    except ValueError:
        pass
    buf = io.BytesIO()
    try:
        img.save(buf, fmt)
    except (OSError, ValueError, KeyError):
        buf = io.BytesIO()
        img.convert("RGB").save(buf, fmt)
    return buf.getvalue()


def png_claiming(w: int, h: int, payload: bytes = b"\x00" * 16) -> bytes:
    """A well-formed PNG header (valid CRCs) claiming w x h, with a few bytes of pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(payload)) + chunk(b"IEND", b"")


def jpeg_claiming(w: int, h: int) -> bytes:
    """A small real JPEG whose frame header (SOF0) is rewritten to claim w x h."""
    data = bytearray(encode_image(16, 16, "RGB", "JPEG", False, 1))
    sof = data.find(b"\xff\xc0")
    data[sof + 5: sof + 9] = struct.pack(">HH", h, w)
    return bytes(data)


SIDES = st.one_of(st.integers(1, 320), st.sampled_from([1, 2, 3, 5, 7, 16, 1000, 2000, 5000]))


@st.composite
def image_bytes(draw, max_pixels: int) -> tuple[str, bytes]:
    """(kind, bytes): a real image of random size/mode/format, possibly damaged, or a lying header."""
    what = draw(st.sampled_from(["image", "image", "image", "png-header", "jpeg-header"]))
    if what == "png-header":
        side = st.one_of(st.integers(0, 3000), st.integers(0, 2**31 - 1))
        return "image-header", png_claiming(draw(side), draw(side))
    if what == "jpeg-header":
        side = st.one_of(st.integers(0, 3000), st.integers(0, 65535))
        return "image-header", jpeg_claiming(draw(side), draw(side))
    w = draw(SIDES)
    h = draw(SIDES.filter(lambda v: v * w <= max_pixels))  # what is really allocated here
    fmt = draw(st.sampled_from(IMAGE_FORMATS))
    data = encode_image(w, h, draw(st.sampled_from(MODES)), fmt, noise=w * h <= 90_000 and draw(st.booleans()),
                        seed=draw(st.integers(0, 255)))
    damage = draw(st.sampled_from(["none", "none", "truncate", "flip", "prefix"]))
    if damage == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif damage == "flip":
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] = draw(st.integers(0, 255))
        data = bytes(buf)
    elif damage == "prefix":
        data = draw(st.binary(min_size=1, max_size=8)) + data
    return ("image" if damage == "none" else "image-damaged"), data


# -- images at the shipped default limits (the campaign) ------------------------------
# handlers/packrat_tasks/image.py's defaults: 25,000,000 pixels from the header, 10 MiB
# encoded, aspect ratio 20:1, 4,194,304 pixels decoded at full size (PNG, progressive
# JPEG). config.properties (`make run`, the campaign) sets no max_request_size, so
# TorchServe's frontend refuses a body above 6,553,500 bytes before the handler's
# 10 MiB can bind. Sizes around each of these, both orientations of the long ones.
LARGE_SIZES = (
    (5000, 5000),  # 25,000,000: at the pixel limit
    (4999, 5001), (5001, 5000),  # one pixel row under, 5,000 pixels over
    (6000, 4200), (8000, 8000),  # over (8000x8000 is also over PIL's 2x bomb check)
    (22360, 1118), (1118, 22360),  # aspect 20.0, 24,998,480 pixels: both limits at once
    (22400, 1100),  # aspect 20.4: refused for its shape
    (2048, 2048), (2049, 2048),  # the full-size decode limit and one column over
    (7000, 3500),
)
LARGE_FORMATS = ("JPEG", "JPEG-progressive", "PNG")
LARGE_CONTENTS = ("flat", "gradient", "noise")
REQUEST_LIMIT = 6_553_500  # TorchServe's default max_request_size
IMAGE_BYTES_LIMIT = 10 * 1024 * 1024
# Image lengths the padding aims at (± 64 bytes): a raw body at TorchServe's limit, a
# base64 JSON body ({"image": "..."}, 13 bytes around it) at that limit, the 10 MiB limit.
PAD_TARGETS = (REQUEST_LIMIT, (REQUEST_LIMIT - 13) * 3 // 4, IMAGE_BYTES_LIMIT)


@functools.lru_cache(maxsize=32)  # each drawn once and reused: generating must not dominate the campaign
def large_image(w: int, h: int, mode: str, fmt: str, content: str) -> bytes:
    """A w x h image of cheap content (a flat colour, a gradient, a gradient with a
    repeating 64x64 noise tile), encoded as `fmt` (one of LARGE_FORMATS)."""
    import numpy as np

    channels = () if mode == "L" else (3,)
    if content == "flat":
        pixels = np.full((h, w) + channels, 128, dtype=np.uint8)
    else:
        x = np.linspace(0, 255, w, dtype=np.float32).astype(np.uint8)[None, :]
        y = np.linspace(0, 255, h, dtype=np.float32).astype(np.uint8)[:, None]
        pixels = np.empty((h, w) + channels, dtype=np.uint8)
        if channels:
            pixels[..., 0], pixels[..., 1], pixels[..., 2] = x, y, x // 2 + y // 2
        else:
            pixels[...] = x // 2 + y // 2
        if content == "noise":  # a tile: JPEG sizes grow with it, PNG's deflate still finds the repeats
            tile = np.random.default_rng(w * h).integers(0, 24, (64, 64) + channels, dtype=np.uint8)
            reps = (-(-h // 64), -(-w // 64)) + (1,) * len(channels)
            pixels += np.tile(tile, reps)[:h, :w]
    buf = io.BytesIO()
    if fmt == "PNG":
        Image.fromarray(pixels).save(buf, "PNG", compress_level=1)
    else:
        Image.fromarray(pixels).save(buf, "JPEG", progressive=fmt == "JPEG-progressive")
    return buf.getvalue()


def pad_to(data: bytes, size: int) -> bytes:
    """`data` (a PNG or JPEG) grown to `size` bytes with ancillary data a decoder skips:
    a private PNG chunk before IEND, JPEG comment segments after SOI. Returned as it is
    when it is already that large or when the padding's own framing does not fit."""
    missing = size - len(data)
    if data.startswith(b"\x89PNG") and missing >= 12:
        body = b"\x00" * (missing - 12)
        chunk = struct.pack(">I", len(body)) + b"prVt" + body + struct.pack(">I", zlib.crc32(b"prVt" + body))
        return data[:-12] + chunk + data[-12:]  # IEND is the last 12 bytes
    if data.startswith(b"\xff\xd8") and missing >= 4:
        count = -(-missing // 65537)  # a segment: 4 bytes of marker and length, up to 65533 of payload
        q, r = divmod(missing - 4 * count, count)
        segments = [b"\xff\xfe" + struct.pack(">H", n + 2) + b"\x00" * n for n in [q + 1] * r + [q] * (count - r)]
        return data[:2] + b"".join(segments) + data[2:]
    return data


@st.composite
def large_images(draw) -> tuple[str, bytes]:
    """(kind, bytes): an image at or past the default limits, sometimes padded to a body limit or cut."""
    w, h = draw(st.sampled_from(LARGE_SIZES))
    data = large_image(w, h, draw(st.sampled_from(["RGB", "RGB", "L"])), draw(st.sampled_from(LARGE_FORMATS)),
                       draw(st.sampled_from(LARGE_CONTENTS)))
    if draw(st.booleans()):
        data = pad_to(data, draw(st.sampled_from(PAD_TARGETS)) + draw(st.integers(-64, 64)))
    if draw(st.integers(0, 4)) == 0:
        return "image-large-damaged", data[: draw(st.integers(0, len(data)))]
    return "image-large", data


B64_JUNK = st.text(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ \n.:;é"),
                   max_size=200)


@st.composite
def image_requests(draw, max_pixels: int, large: bool = False) -> Fuzz:
    """An image request; with `large`, half of them from large_images()."""
    if large and draw(st.booleans()):
        kind, data = draw(large_images())
    else:
        kind, data = draw(image_bytes(max_pixels))
    how = draw(st.sampled_from(["raw", "raw", "base64", "base64-mangled", "base64-junk"]))
    if how == "raw":
        return Fuzz(kind, data, draw(st.sampled_from([None, "image/png", "image/jpeg", "application/octet-stream"])))
    encoded = base64.b64encode(data).decode()
    if how == "base64-mangled":
        mangle = draw(st.sampled_from(["unpadded", "newlines", "data-url", "urlsafe", "cut"]))
        encoded = {
            "unpadded": encoded.rstrip("="),
            "newlines": "\n".join(encoded[i:i + 76] for i in range(0, len(encoded), 76)),
            "data-url": "data:image/png;base64," + encoded,
            "urlsafe": base64.urlsafe_b64encode(data).decode(),
            "cut": encoded[: draw(st.integers(0, len(encoded)))],
        }[mangle]
    elif how == "base64-junk":
        encoded = draw(B64_JUNK)
    obj: dict = {"image": encoded}
    if draw(st.booleans()):
        obj["top_k"] = draw(st.one_of(st.integers(-3, 15), JSON_VALUES))
    b64_kind = "base64" if how == "base64" and kind in ("image", "image-large") else "base64-bad"
    return Fuzz(b64_kind + ("-large" if kind.startswith("image-large") else ""), _dump(obj, True),
                draw(JSON_TYPES))


# -- per task ---------------------------------------------------------------------
TEXT_FIELDS = {"text": TEXTS}
GENERATION_FIELDS = {"text": TEXTS, "max_new_tokens": st.one_of(st.integers(-5, 40), st.integers())}


def requests_for(task: str, body_limit: int = 1 << 20, max_pixels: int = 1_000_000,
                 large: bool = False) -> st.SearchStrategy[Fuzz]:
    """Fuzzed requests for one task. `body_limit`: its handler's body limit (the size
    probes aim there); `max_pixels`: the largest image of any mode and format drawn
    (1,000,000 as base64 BMP is 4 MB, under TorchServe's 6.5 MB request limit);
    `large`: images at and past the default limits too (large_images())."""
    common = [raw_bytes(), any_json(), nested_json(), huge_numbers(), big_bodies(body_limit), form_bodies()]
    if task == "noop":
        return st.one_of(*common, raw_text())
    if task in ("text-classification", "feature-extraction"):
        return st.one_of(*common, raw_text(), json_bodies(TEXT_FIELDS))
    if task == "text-generation":
        return st.one_of(*common, raw_text(), json_bodies(GENERATION_FIELDS))
    if task == "image-classification":
        images = image_requests(max_pixels, large)
        return st.one_of(*common, images, images, images)
    raise ValueError(task)


def good_request(task: str) -> dict:
    """A valid request for the task (kwargs for tests/serving_support.predict)."""
    if task == "image-classification":
        return {"body": encode_image(64, 48, "RGB", "PNG", True, 3)}
    return {"body": b"a perfectly fine input"}
