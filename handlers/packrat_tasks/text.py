"""`text-classification` (BERT-family with a classifier head) and `feature-extraction`
(a BERT-family encoder, mean-pooled and L2-normalised, as sentence-transformers'
all-MiniLM-L6-v2 does).

Input per request: raw UTF-8 text, or JSON {"text": "..."}. Texts longer than
`packrat.max_length` tokens (special tokens included) are refused with 413
rather than silently truncated; before tokenising, a text is bounded by
characters (`packrat.max_text_chars`, default TEXT_CHARS_PER_TOKEN x max_length).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from packrat_tasks.base import (
    TEXT_CHARS_PER_TOKEN, Batch, RequestError, Task, check_text, get_field, model_labels, parse_json_or_text,
)
from packrat_tasks.runtime import build_runner, framework_model, needs_fixed_shapes
from packrat_tasks.samples import sample_text
from packrat_tasks.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

class _Classifier(torch.nn.Module):
    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]


class _MeanPooledEncoder(torch.nn.Module):
    """Encoder + mean pooling over real tokens + L2 normalisation, in one graph."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * mask).sum(dim=1)
        pooled = summed / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=1)


class _TextTask(Task):
    auto_class = "AutoModel"
    adapter = _MeanPooledEncoder
    guard_kind = "embedding"  # how the accuracy guard compares outputs (guard.py)

    def __init__(self, model_dir: str, config: dict[str, Any]) -> None:
        super().__init__(model_dir, config)
        section = config.get("packrat") or {}
        path = os.path.join(model_dir, section.get("model_dir", "model"))
        self.tokenizer = load_tokenizer(path)

        def load() -> PreTrainedModel:
            import transformers

            return getattr(transformers, self.auto_class).from_pretrained(path).eval()

        # A mode served from the build cache alone never loads the model, nor imports transformers.
        self.model, module = framework_model(load, self.adapter, model_dir, config, self.guard_kind)
        self.id2label = model_labels(path)
        self.max_length = int(section.get("max_length", 128))
        self.max_text_chars = int(section.get("max_text_chars", TEXT_CHARS_PER_TOKEN * self.max_length))
        # Graph modes specialised to shapes get every batch padded to max_length.
        self.fixed_length = needs_fixed_shapes(config)
        row = [self.tokenizer.cls_token_id or 0] * 8
        example = self._encode([row] * 2, self.max_length)
        # Builds the configured mode, warms it up (eager: on one 8-token row) and checks it
        # against fp32 eager.
        self.runner = build_runner(self, module, example, config, self.guard_kind,
                                   warmup_inputs=self._encode([row], len(row)))

    def parse(self, request: dict) -> list[int]:
        obj = parse_json_or_text(request, self.max_body_bytes, self.max_json_depth)
        text = get_field(obj, "text", str, required=True) if isinstance(obj, dict) else obj
        check_text(text, self.max_text_chars)
        ids = self.tokenizer(text, add_special_tokens=True).input_ids
        if len(ids) > self.max_length:
            raise RequestError(
                413, f"text is {len(ids)} tokens long; this model accepts at most {self.max_length}"
            )
        return ids

    def _encode(self, rows: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Filled in numpy, handed to torch without a copy: a torch op per row cost
        # 72 us a batch of four 7-token texts on an AMD EPYC Zen 3, numpy 8 us.
        pad = self.tokenizer.pad_token_id or 0
        ids = np.full((len(rows), length), pad, dtype=np.int64)
        mask = np.zeros((len(rows), length), dtype=np.int64)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = row
            mask[r, : len(row)] = 1
        return torch.from_numpy(ids), torch.from_numpy(mask)

    def collate(self, batch: Batch) -> None:
        rows = [batch.items[i] for i in batch.valid]
        length = self.max_length if self.fixed_length else max(len(r) for r in rows)
        batch.inputs["input_ids"], batch.inputs["attention_mask"] = self._encode(rows, length)

    def forward(self, batch: Batch) -> Batch:
        batch.outputs = self.runner(batch.inputs["input_ids"], batch.inputs["attention_mask"])
        return batch

    def served_sizes(self, batch: Batch, responses: list[Any]) -> dict[str, list[int]]:
        return {"tokens": [len(batch.items[i]) for i in batch.valid]}  # special tokens included

    def sample_requests(self, n: int, sizes: dict[str, int] | None = None) -> list[dict]:
        # [CLS] word [SEP] at least; max_length at most (and by default: the longest input served)
        tokens = max(3, min(self.max_length, int((sizes or {}).get("tokens", self.max_length))))
        text = sample_text(self.tokenizer, tokens)
        return [{"body": text.encode("utf-8")} for _ in range(n)]


class FeatureExtractionTask(_TextTask):
    name = "feature-extraction"

    def respond(self, batch: Batch) -> list[Any]:
        return [{"embedding": row.tolist()} for row in batch.outputs.float()]


class TextClassificationTask(_TextTask):
    name = "text-classification"
    auto_class = "AutoModelForSequenceClassification"
    adapter = _Classifier
    guard_kind = "classification"

    def respond(self, batch: Batch) -> list[Any]:
        id2label = self.id2label
        probs = torch.softmax(batch.outputs.float(), dim=-1)
        out = []
        for row in probs:
            best = int(row.argmax())
            out.append({
                "label": id2label[best],
                "scores": {id2label[j]: float(p) for j, p in enumerate(row)},
            })
        return out
