"""`image-classification`: ResNet-style classifiers (transformers' ResNetForImageClassification).

Input per request: raw JPEG/PNG bytes, or JSON {"image": "<base64>", "top_k": k}.
Pre-processing with PIL + numpy (torchvision does not import beside this torch):
RGB, shorter side resized to 256 (bilinear), centre crop 224x224, scaled to
[0, 1], normalised with the ImageNet mean/std, CHW. Output: the top-k labels
with softmax probabilities.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from packrat_tasks.base import Batch, RequestError, Task, get_field, reject_form, request_value
from packrat_tasks.runtime import build_runner
from packrat_tasks.samples import sample_jpeg

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
RESIZE, CROP = 256, 224
FORMATS = {"JPEG", "PNG"}


def to_pixels(img: Image.Image) -> np.ndarray:
    """PIL image -> float32 CHW array, the standard ImageNet evaluation transform."""
    img = img.convert("RGB")
    w, h = img.size
    scale = RESIZE / min(w, h)
    img = img.resize((max(RESIZE, round(w * scale)), max(RESIZE, round(h * scale))),
                     Image.Resampling.BILINEAR)
    w, h = img.size
    left, top = (w - CROP) // 2, (h - CROP) // 2
    img = img.crop((left, top, left + CROP, top + CROP))
    arr = np.asarray(img, dtype=np.float32) / 255.0
    return ((arr - MEAN) / STD).transpose(2, 0, 1)


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
        import transformers

        section = config.get("packrat") or {}
        path = os.path.join(model_dir, section.get("model_dir", "model"))
        self.model = transformers.AutoModelForImageClassification.from_pretrained(path).eval()
        self.labels = self.model.config.id2label
        self.top_k = min(int(section.get("top_k", 5)), len(self.labels))
        self.max_bytes = int(section.get("max_image_bytes", 10 * 1024 * 1024))
        self.max_pixels = int(section.get("max_image_pixels", 25_000_000))
        example = (torch.zeros(2, 3, CROP, CROP),)
        self.runner = build_runner(self, _Logits(self.model), example, config, "classification")

    def _image_bytes(self, request: dict) -> tuple[bytes, int]:
        reject_form(request)
        value = request_value(request)
        top_k = self.top_k
        if isinstance(value, (bytes, bytearray)) and bytes(value[:1]) == b"{":
            try:
                value = json.loads(bytes(value).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise RequestError(400, f"malformed JSON body: {exc}") from None
        if isinstance(value, dict):
            encoded = get_field(value, "image", str, required=True)
            top_k = get_field(value, "top_k", int, default=self.top_k)
            if not 1 <= top_k <= len(self.labels):
                raise RequestError(400, f"top_k must be between 1 and {len(self.labels)}, got {top_k}")
            try:
                value = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError):
                raise RequestError(400, "field 'image' is not valid base64") from None
        if value is None or (isinstance(value, (bytes, bytearray, str)) and len(value) == 0):
            raise RequestError(400, "empty request body")
        if not isinstance(value, (bytes, bytearray)):
            raise RequestError(400, "expected JPEG/PNG bytes or a JSON object with a base64 'image'")
        return bytes(value), top_k

    def parse(self, request: dict) -> tuple[np.ndarray, int]:
        data, top_k = self._image_bytes(request)
        if len(data) > self.max_bytes:
            raise RequestError(413, f"image is {len(data)} bytes; the limit is {self.max_bytes}")
        try:
            img = Image.open(io.BytesIO(data))  # lazy: reads the header only
        except UnidentifiedImageError:
            raise RequestError(400, "body is not a JPEG or PNG image") from None
        except Image.DecompressionBombError:
            raise RequestError(413, "image has too many pixels") from None
        if img.format not in FORMATS:
            raise RequestError(415, f"image format {img.format} is not supported; send JPEG or PNG")
        w, h = img.size
        if w * h > self.max_pixels:
            raise RequestError(413, f"image is {w}x{h} = {w * h} pixels; the limit is {self.max_pixels}")
        try:
            return to_pixels(img), top_k
        except (OSError, ValueError, SyntaxError) as exc:
            raise RequestError(400, f"image data is corrupt: {exc}") from None

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

    def sample_requests(self, n: int) -> list[dict]:
        image = sample_jpeg()
        return [{"body": image} for _ in range(n)]
