"""A stand-in archive for profiler tests: same `packrat_handler` interface as handlers/.

load_task(model_dir, model_yaml_config) -> Task with sample_requests(n),
preprocess(requests), forward(inputs), postprocess(outputs), run(requests).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

HANDLER_SOURCE = '''
import json

import torch


class Task:
    def __init__(self, width: int) -> None:
        torch.manual_seed(0)
        self.width = width
        self.model = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
        ).eval()

    def sample_requests(self, n):
        return [{"body": json.dumps({"x": [float(i % 7)] * self.width}).encode()} for i in range(n)]

    def preprocess(self, requests):
        return torch.tensor([json.loads(r["body"])["x"] for r in requests])

    def forward(self, inputs):
        with torch.inference_mode():
            return self.model(inputs)

    def postprocess(self, outputs):
        return [{"label": int(row.argmax())} for row in outputs]

    def run(self, requests):
        return self.postprocess(self.forward(self.preprocess(requests)))


def load_task(model_dir, model_yaml_config):
    return Task(int(model_yaml_config.get("width", 64)))
'''


def make_tiny_archive(directory: Path, width: int = 64, extra_config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "packrat_handler.py").write_text(HANDLER_SOURCE)
    config = {"width": width, "batchSize": 4, "minWorkers": 1, "maxWorkers": 1, **(extra_config or {})}
    (directory / "model_config.yaml").write_text(yaml.safe_dump(config))
    (directory / "MAR-INF").mkdir(exist_ok=True)
    (directory / "MAR-INF" / "MANIFEST.json").write_text(
        json.dumps({"createdOn": "01/01/2026 00:00:00", "modelVersion": "1.0",
                    "model": {"modelName": "tiny", "handler": "packrat_handler.py"}})
    )
    return directory
