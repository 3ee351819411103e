"""`image-classification`: ResNet-style classifiers (transformers' ResNetForImageClassification).

Input per request: raw JPEG/PNG bytes, or JSON {"image": "<base64>", "top_k": k}.
Pre-processing with PIL + numpy (torchvision does not import beside this torch):
RGB, shorter side resized to 256 (bilinear), centre crop 224x224, scaled to
[0, 1], normalised with the ImageNet mean/std, CHW. Output: the top-k labels
with softmax probabilities.

Every input is bounded before it costs (docs/handler.md): body and base64 sizes
before decoding, the format from the header (JPEG/PNG only), then pixels,
aspect ratio and the size after resizing from the header's width and height,
all before any pixel is decoded. A baseline JPEG is decoded at reduced size in
the DCT (PIL's draft(): 1/2, 1/4 or 1/8, never below the resize's size), so a
25-megapixel photo costs what a 0.4-megapixel one does; what must be decoded at
full size (PNG, progressive JPEG) is bounded by max_decoded_pixels.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import struct
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from packrat_tasks.base import (
    Batch, RequestError, Task, check_body_size, decoded_depth_exceeds, get_field,
    load_json, model_labels, reject_form, request_value,
)
from packrat_tasks.runtime import build_runner, framework_model
from packrat_tasks.samples import sample_jpeg

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
# (x / 255 - MEAN) / STD as one multiply-add per channel: x * SCALE + SHIFT.
SCALE = (1.0 / (255.0 * STD)).astype(np.float32)
SHIFT = (-MEAN / STD).astype(np.float32)
RESIZE, CROP = 256, 224
FORMATS = ("JPEG", "PNG")  # the only decoders PIL may run on a request (Image.open(formats=))
# Formats recognised by their magic bytes only to say "unsupported" (415)
# without running their decoders.
OTHER_FORMATS = ((b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"),
                 (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"), (b"8BPS", "PSD"))

# Defaults, each overridable under model_config.yaml's `packrat:` section.
MAX_IMAGE_BYTES = 10 * 1024 * 1024  # packrat.max_image_bytes: the encoded image
MAX_IMAGE_PIXELS = 25_000_000  # packrat.max_image_pixels: width x height, read from the header
# packrat.max_aspect_ratio: the resize scales the shorter side to RESIZE, so the
# resized image has RESIZE^2 x aspect pixels (a 40000x5 PNG of 661 bytes took 7.7 s).
MAX_ASPECT_RATIO = 20
# packrat.max_resized_pixels: bounds the resize's output; with the default aspect
# limit (at most 256 x 5120) it never binds, it guards archives that raise that limit.
MAX_RESIZED_PIXELS = 1 << 21
# packrat.max_decoded_pixels: the pixels a decoder holds at full size. A PNG has no
# reduced decode and libjpeg buffers every coefficient of a progressive JPEG: a
# 5000x5000 PNG decoded in 75 ms of CPU, a 2048x2048 RGBA one in 47-63 ms (2-core EPYC,
# docs/benchmarks/decode-bounds-epyc.md).
MAX_DECODED_PIXELS = 1 << 22
JSON_ENVELOPE_BYTES = 4096  # a JSON body may exceed the base64 image by this much


def base64_length(n_bytes: int) -> int:
    return 4 * ((n_bytes + 2) // 3)


def resized_size(w: int, h: int) -> tuple[int, int]:
    """The size to_pixels() resizes a w x h image to (shorter side -> RESIZE)."""
    scale = RESIZE / min(w, h)
    return max(RESIZE, round(w * scale)), max(RESIZE, round(h * scale))


def reduce_on_decode(img: Image.Image) -> int:
    """Set up the decode of an opened (not yet decoded) image; returns the pixels its
    decoder will hold.

    A baseline JPEG is decoded at the smallest DCT scale that keeps both sides at
    least the resize's (draft(): no pixel is computed at full size, the DCT's
    scaling averages like a box filter); the resize then works from that. A
    progressive JPEG gets the same scale, but libjpeg still buffers every
    coefficient of the full image, and a PNG is decoded whole: both count at
    full size.
    """
    w, h = img.size
    if img.format != "JPEG":
        return w * h
    img.draft(None, resized_size(w, h))  # mode unchanged: PIL's JPEG decoder already gives RGB
    if img.info.get("progressive") or img.info.get("progression"):
        return w * h
    return img.size[0] * img.size[1]


# What PIL may raise on corrupt or hostile data: the four its own open() takes
# for "not this format" (SyntaxError, IndexError, TypeError, struct.error) and
# what decoding raises (OSError for truncated data, ValueError, EOFError). A
# refusal of that request (400), not a model failure of the batch.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError,
                 TypeError, Image.DecompressionBombError)


def to_pixels(img: Image.Image) -> np.ndarray:
    """PIL image -> float32 CHW array, the standard ImageNet evaluation transform.

    Resize-then-centre-crop in one step: PIL resizes only the source box that the
    crop keeps, straight to CROP x CROP, with the same filter and scale, so the
    pixels outside the crop are never computed (a 320x240 JPEG: 1.2-1.5 instead of
    1.6-2.4 ms CPU per image on the 2-core EPYC). It differs from the two-step
    transform by at most one 8-bit level (PIL's passes round at other points).
    """
    img = img.convert("RGB")
    w, h = img.size
    rw, rh = resized_size(w, h)
    left, top = (rw - CROP) // 2, (rh - CROP) // 2
    sx, sy = w / rw, h / rh
    img = img.resize((CROP, CROP), Image.Resampling.BILINEAR,
                     box=(left * sx, top * sy, (left + CROP) * sx, (top + CROP) * sy))
    # Normalised channel by channel straight into a contiguous CHW array: one pass per
    # channel instead of four float passes and a transposed copy (0.08 instead of ~0.4 ms
    # per image; equal to the textbook formula within float rounding, ~5e-7).
    pixels = np.asarray(img)
    out = np.empty((3, CROP, CROP), dtype=np.float32)
    for c in range(3):
        np.multiply(pixels[:, :, c], SCALE[c], out=out[c], casting="unsafe")
        out[c] += SHIFT[c]
    return out


class _Logits(torch.nn.Module):
    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values, return_dict=False)[0]


class ImageClassificationTask(Task):
    name = "image-classification"

    def __init__(self, model_dir: str, config: dict[str, Any]) -> None:
        super().__init__(model_dir, config)
        section = config.get("packrat") or {}
        path = os.path.join(model_dir, section.get("model_dir", "model"))

        def load() -> PreTrainedModel:
            import transformers

            return transformers.AutoModelForImageClassification.from_pretrained(path).eval()

        # A mode served from the build cache alone never loads the model, nor imports transformers.
        self.model, module = framework_model(load, _Logits, model_dir, config, "classification")
        self.labels = model_labels(path)
        self.top_k = min(int(section.get("top_k", 5)), len(self.labels))
        self.max_bytes = int(section.get("max_image_bytes", MAX_IMAGE_BYTES))
        self.max_pixels = int(section.get("max_image_pixels", MAX_IMAGE_PIXELS))
        self.max_aspect = float(section.get("max_aspect_ratio", MAX_ASPECT_RATIO))
        self.max_resized = int(section.get("max_resized_pixels", MAX_RESIZED_PIXELS))
        self.max_decoded = int(section.get("max_decoded_pixels", MAX_DECODED_PIXELS))
        self.max_base64 = base64_length(self.max_bytes)
        # A JSON body carries the image as base64; the raw body limit follows from it.
        self.max_body_bytes = int(section.get("max_body_bytes", self.max_base64 + JSON_ENVELOPE_BYTES))
        # PIL's own decompression-bomb check in Image.open (process-wide: one task
        # per worker): it refuses more than twice this; parse() refuses above it.
        Image.MAX_IMAGE_PIXELS = self.max_pixels
        example = (torch.zeros(2, 3, CROP, CROP),)
        self.runner = build_runner(self, module, example, config, "classification")

    def _image_bytes(self, request: dict) -> tuple[bytes, int]:
        reject_form(request)
        value = request_value(request)
        top_k = self.top_k
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value)
            check_body_size(value, self.max_body_bytes)
            if value.lstrip()[:1] == b"{":  # JPEG and PNG bytes never start so
                value = load_json(value, self.max_json_depth)
                if not isinstance(value, dict):
                    raise RequestError(400, f"expected a JSON object, got a JSON {type(value).__name__}")
        if isinstance(value, dict):
            if decoded_depth_exceeds(value, self.max_json_depth):
                raise RequestError(400, f"JSON nesting depth exceeds the limit of {self.max_json_depth}")
            encoded = get_field(value, "image", str, required=True)
            top_k = get_field(value, "top_k", int, default=self.top_k)
            if not 1 <= top_k <= len(self.labels):
                raise RequestError(400, f"top_k must be between 1 and {len(self.labels)}, got {top_k}")
            if len(encoded) > self.max_base64:
                raise RequestError(413, f"field 'image' is {len(encoded)} base64 characters; the limit "
                                        f"is {self.max_base64} ({self.max_bytes} bytes decoded)")
            try:  # strict: only the base64 alphabet with correct padding, no whitespace
                value = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError):
                raise RequestError(400, "field 'image' is not valid base64 (standard alphabet, "
                                        "padded, no whitespace or data: prefix)") from None
        if value is None or (isinstance(value, (bytes, bytearray, str)) and len(value) == 0):
            raise RequestError(400, "empty request body")
        if not isinstance(value, (bytes, bytearray)):
            raise RequestError(400, "expected JPEG/PNG bytes or a JSON object with a base64 'image'")
        return bytes(value), top_k

    def parse(self, request: dict) -> tuple[np.ndarray, int, int]:
        """(pixels, top_k, width x height as sent: its size in the worker's histogram)."""
        data, top_k = self._image_bytes(request)
        if len(data) > self.max_bytes:
            raise RequestError(413, f"image is {len(data)} bytes; the limit is {self.max_bytes}")
        try:
            # Lazy: reads the header only, and runs no decoder but JPEG's and PNG's.
            img = Image.open(io.BytesIO(data), formats=FORMATS)
        except UnidentifiedImageError:
            other = next((name for magic, name in OTHER_FORMATS if data.startswith(magic)), None)
            if other is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
                other = "WEBP"
            if other:
                raise RequestError(415, f"image format {other} is not supported; send JPEG or PNG") from None
            raise RequestError(400, "body is not a JPEG or PNG image") from None
        except Image.DecompressionBombError:
            raise RequestError(413, f"image has more than twice the limit of {self.max_pixels} pixels") from None
        except DECODE_ERRORS as exc:
            raise RequestError(400, f"image header is corrupt: {exc}") from None
        if img.format not in FORMATS:  # e.g. MPO, which PIL's JPEG opener may return
            raise RequestError(415, f"image format {img.format} is not supported; send JPEG or PNG")
        self._check_size(*img.size)
        sent = img.size[0] * img.size[1]  # before draft() reduces img.size
        try:
            decoded = reduce_on_decode(img)
            if decoded > self.max_decoded:
                w, h = img.size
                raise RequestError(413, f"image is {w}x{h} {img.format}: decoded at full size, {decoded} "
                                        f"pixels; the limit is {self.max_decoded}")
            return to_pixels(img), top_k, sent
        except DECODE_ERRORS as exc:
            raise RequestError(400, f"image data is corrupt: {exc}") from None

    def _check_size(self, w: int, h: int) -> None:
        """Refuse, from the header's size alone, what would cost too much to decode or resize."""
        if w < 1 or h < 1:
            raise RequestError(400, f"image is {w}x{h}: it has no pixels")
        if w * h > self.max_pixels:
            raise RequestError(413, f"image is {w}x{h} = {w * h} pixels; the limit is {self.max_pixels}")
        if max(w, h) / min(w, h) > self.max_aspect:
            raise RequestError(400, f"image is {w}x{h}: aspect ratio {max(w, h) / min(w, h):.1f}:1 "
                                    f"exceeds the limit of {self.max_aspect:g}:1")
        rw, rh = resized_size(w, h)
        if rw * rh > self.max_resized:
            raise RequestError(413, f"image is {w}x{h}: resized to {rw}x{rh} = {rw * rh} pixels; "
                                    f"the limit is {self.max_resized}")

    def collate(self, batch: Batch) -> None:
        batch.inputs["pixel_values"] = torch.from_numpy(
            np.stack([batch.items[i][0] for i in batch.valid])
        )

    def forward(self, batch: Batch) -> Batch:
        batch.outputs = self.runner(batch.inputs["pixel_values"])
        return batch

    def respond(self, batch: Batch) -> list[Any]:
        probs = torch.softmax(batch.outputs.float(), dim=-1)
        out = []
        for row, i in zip(probs, batch.valid):
            k = batch.items[i][1]
            values, indices = torch.topk(row, k)
            out.append({"predictions": [
                {"label": self.labels[int(j)], "probability": float(p)}
                for p, j in zip(values, indices)
            ]})
        return out

    def served_sizes(self, batch: Batch, responses: list[Any]) -> dict[str, list[int]]:
        return {"pixels": [batch.items[i][2] for i in batch.valid]}

    def sample_requests(self, n: int, sizes: dict[str, int] | None = None) -> list[dict]:
        pixels = (sizes or {}).get("pixels")
        if pixels:  # a 4:3 photo of about that many pixels, within the limits (the resize makes 224x224)
            pixels = max(1, min(int(pixels), self.max_pixels, self.max_decoded))
            width = round((pixels * 4 / 3) ** 0.5)
            image = sample_jpeg(width, max(1, pixels // width))
        else:
            image = sample_jpeg()
        return [{"body": image} for _ in range(n)]
